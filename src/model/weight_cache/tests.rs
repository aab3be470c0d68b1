use super::key::{file_key, Key};
use super::*;
use std::path::Path;
use std::time::Duration;

fn key() -> Key {
    Key {
        version: FORMAT_VERSION,
        policy: "dense=int4 mla=int8 head=int8".into(),
        files: vec![file_key(
            Path::new("/nowhere/config.json"),
            &crate::checkpoint::file_stamp::FileStamp {
                len: 1,
                modified: None,
                id: None,
                changed: None,
            },
            0,
        )],
    }
}

/// An int8 matrix of `rows` x `cols` with recognisable bytes.
fn parts(name: &str, rows: usize, cols: usize) -> Parts {
    Parts {
        name: name.into(),
        format: "int8",
        rows,
        cols,
        q: (0..rows * cols).map(|i| (i % 251) as u8).collect(),
        scale: (0..rows).flat_map(|r| (r as f32).to_le_bytes()).collect(),
    }
}

fn pause(b: &Building, on: bool) {
    b.queue.set_paused(on);
}

fn building(path: &Path) -> Building {
    Builder::create(path, key()).unwrap().spawn(None)
}

fn ends_before_writer(path: &Path) -> (WriteReport, bool) {
    let mut b = building(path);
    pause(&b, true);
    for (i, rows) in [64usize, 128, 32].into_iter().enumerate() {
        let p = parts(&format!("m{i}"), rows, 4096);
        b.sent += p.bytes();
        b.queue.send(p);
    }
    let cache = WeightCache {
        state: State::Build(b),
        notes: Vec::new(),
    };
    let (line, _, pending) = cache.finish_in_background(false);
    assert!(line.starts_with("writing 1 MB to "), "{line}");
    let pending = pending.unwrap();
    let running = !pending.is_done();
    assert!(
        !path.exists(),
        "the file is in place before the writer wrote it"
    );
    let b = pending.building.as_ref().unwrap();
    let queue = Arc::clone(&b.queue);
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        queue.set_paused(false);
    });
    let r = pending.wait();
    resume.join().unwrap();
    (r, running)
}

#[test]
fn a_process_that_ends_while_the_writer_writes_waits_for_a_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file_name(&FormatPolicy::default()));
    let (r, running) = ends_before_writer(&path);
    assert!(running, "the writer was done before the load ended");
    assert!(r.built, "{}", r.line);
    assert!(r.waited_s >= 0.09, "did not wait: {r:?}");
    assert_eq!(r.bytes, std::fs::metadata(&path).unwrap().len());
    assert!(crate::atomic_file::partials_of(&path).is_empty());
    let read = Reader::open(&path, &key()).unwrap();
    assert_eq!(read.entries.len(), 3);
    let m = read.matrix(&read.entries[1], DenseFormat::Int8).unwrap();
    let DenseData::Int8 { q, scale } = m.data else {
        panic!("not int8")
    };
    let want = parts("m1", 128, 4096);
    assert_eq!(bytemuck::cast_slice::<i8, u8>(&q), &want.q[..]);
    assert_eq!(bytemuck::cast_slice::<f32, u8>(&scale), &want.scale[..]);
}

#[test]
fn dropping_the_pending_write_waits_for_it_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file_name(&FormatPolicy::default()));
    let mut b = building(&path);
    pause(&b, true);
    let p = parts("m", 256, 4096);
    b.sent += p.bytes();
    b.queue.send(p);
    let queue = Arc::clone(&b.queue);
    let cache = WeightCache {
        state: State::Build(b),
        notes: Vec::new(),
    };
    let (_, _, pending) = cache.finish_in_background(false);
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        queue.set_paused(false);
    });
    drop(pending);
    resume.join().unwrap();
    assert!(Reader::open(&path, &key()).is_ok());
    assert!(crate::atomic_file::partials_of(&path).is_empty());
}

#[test]
fn a_write_that_fails_after_the_load_leaves_no_file_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    // The destination turns into a non-empty directory while the writer waits: its
    // rename into place fails after everything was written and synced.
    let path = dir.path().join(file_name(&FormatPolicy::default()));
    let mut b = building(&path);
    pause(&b, true);
    let p = parts("m", 16, 4096);
    b.sent += p.bytes();
    b.queue.send(p);
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("x"), b"x").unwrap();
    pause(&b, false);
    let cache = WeightCache {
        state: State::Build(b),
        notes: Vec::new(),
    };
    let (_, _, pending) = cache.finish_in_background(false);
    let r = pending.unwrap().wait();
    assert!(!r.built && r.bytes == 0, "{r:?}");
    assert!(
        r.line.contains("cannot be written") && r.line.contains("renaming"),
        "{}",
        r.line
    );
    assert!(r.stats_line().starts_with("[K3] weight cache: off: "));
    assert!(crate::atomic_file::partials_of(&path).is_empty());
}

#[test]
fn the_load_waits_only_for_a_backlog_past_its_bound() {
    let q = Arc::new(Queue::new(1000));
    q.set_paused(true);
    // A first matrix larger than the bound is taken at once (nothing is queued).
    let big = 2000;
    q.send(Parts {
        name: "big".into(),
        format: "int8",
        rows: 1,
        cols: big,
        q: vec![0; big],
        scale: vec![0; 4],
    });
    let q2 = Arc::clone(&q);
    let second = std::thread::spawn(move || q2.send(parts("small", 1, 64)));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!second.is_finished(), "a full backlog took more");
    q.set_paused(false);
    assert_eq!(q.recv().map(|p| p.name), Some("big".to_string()));
    second.join().unwrap();
    q.close();
    assert_eq!(q.recv().map(|p| p.name), Some("small".to_string()));
    assert!(q.recv().is_none());
}

/// A whole cache file of three int8 matrices at `path`.
fn written(path: &Path) {
    let b = building(path);
    let mut cache = WeightCache {
        state: State::Build(b),
        notes: Vec::new(),
    };
    if let State::Build(b) = &mut cache.state {
        for (i, rows) in [64usize, 128, 32].into_iter().enumerate() {
            let p = parts(&format!("m{i}"), rows, 4096);
            b.sent += p.bytes();
            b.queue.send(p);
        }
    }
    assert!(cache.finish().0.starts_with("built"));
}

fn cut_to(path: &Path, len: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(len).unwrap();
}

#[test]
fn a_file_cut_short_after_the_check_is_a_note_naming_it_and_the_load_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file_name(&FormatPolicy::default()));
    written(&path);
    let mut cache = WeightCache {
        state: State::Hit(Reader::open(&path, &key()).unwrap()),
        notes: Vec::new(),
    };
    assert!(cache.take("m0", DenseFormat::Int8, 64, 4096).is_some());
    // Cut inside the second matrix's values: a mapped file would raise SIGBUS here.
    cut_to(&path, 16 + 64 * 4096 + 4096);
    assert!(cache.take("m1", DenseFormat::Int8, 128, 4096).is_none());
    assert!(cache.take("m2", DenseFormat::Int8, 32, 4096).is_none());
    let (line, notes) = cache.finish();
    assert_eq!(line, "off");
    assert_eq!(notes.len(), 1, "{notes:?}");
    let note = &notes[0];
    assert!(
        note.contains(&path.display().to_string())
            && note.contains("`m1` values")
            && note.contains("truncated")
            && note.contains("next start rebuilds it"),
        "{note}"
    );
    assert!(!path.exists(), "the cut file was kept");
}

#[test]
fn a_file_rewritten_in_place_after_the_check_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file_name(&FormatPolicy::default()));
    written(&path);
    let r = Reader::open(&path, &key()).unwrap();
    let e = r.entries[1].clone();
    let mut b = std::fs::read(&path).unwrap();
    b[e.q.offset as usize + 7] ^= 1;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &b))
        .unwrap();
    let err = format!("{:#}", r.matrix(&e, DenseFormat::Int8).unwrap_err());
    assert!(
        err.contains(&path.display().to_string()) && err.contains("changed since"),
        "{err}"
    );
}

#[test]
fn a_file_cut_short_while_it_is_checked_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file_name(&FormatPolicy::default()));
    written(&path);
    let err = Reader::open_checked(&path, &key(), || cut_to(&path, 16 + 64 * 4096))
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(
        err.contains(&path.display().to_string()) && err.contains("truncated"),
        "{err}"
    );
}
