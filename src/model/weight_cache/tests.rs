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
    let m = read.matrix(&read.entries[1], DenseFormat::Int8);
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
