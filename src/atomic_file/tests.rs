//! The atomic writer's tests: temporaries, outputs that are not regular files, leftovers.

use super::*;
#[cfg(unix)]
use std::os::unix::fs::FileTypeExt;
#[cfg(unix)]
use std::sync::mpsc;

/// Runs `f` on a thread; a call still running after 20 s is the hang these tests
/// guard against.
#[cfg(unix)]
fn within_limit<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} did not end within 20 s"))
}

/// Sets the modification time of `path` to `ago` before now.
#[cfg(unix)]
fn age(path: &Path, ago: Duration) {
    let f = File::options().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - ago).unwrap();
}

#[cfg(unix)]
fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn committed_file_appears_whole_and_the_partial_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.bin");
    let mut f = AtomicFile::create(&path).unwrap();
    f.write_all(b"hello ").unwrap();
    f.write_all(b"world").unwrap();
    assert!(!path.exists(), "nothing under the real name before commit");
    assert_eq!(partials_of(&path).len(), 1);
    assert_eq!(f.commit().unwrap(), 11);
    assert_eq!(std::fs::read(&path).unwrap(), b"hello world");
    assert!(partials_of(&path).is_empty());
}

#[test]
fn dropped_uncommitted_file_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.bin");
    std::fs::write(&path, b"old").unwrap();
    let mut f = AtomicFile::create(&path).unwrap();
    f.write_all(b"new but unfinished").unwrap();
    drop(f);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"old",
        "the old file is kept"
    );
    assert!(partials_of(&path).is_empty());
}

#[test]
fn a_failed_commit_removes_the_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d");
    let mut f = AtomicFile::create(&path).unwrap();
    f.write_all(b"bytes").unwrap();
    // A non-empty directory takes the name: the rename fails after the sync.
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("x"), b"x").unwrap();
    let e = format!("{:#}", f.commit().unwrap_err());
    assert!(e.contains("renaming"), "{e}");
    assert!(partials_of(&path).is_empty());
}

#[test]
fn two_writers_of_one_name_get_their_own_temporaries() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared");
    let mut a = AtomicFile::create(&path).unwrap();
    let mut b = AtomicFile::create(&path).unwrap();
    a.write_all(b"aaaa").unwrap();
    b.write_all(b"bb").unwrap();
    assert_eq!(partials_of(&path).len(), 2);
    b.commit().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"bb");
    a.commit().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"aaaa", "whole, never mixed");
}

#[cfg(unix)]
#[test]
fn a_fifo_or_symlink_at_the_old_partial_name_is_never_opened() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    let (a, b) = (dir.path().join("a.cache"), dir.path().join("b.cache"));
    mkfifo(&dir.path().join("a.cache.partial"));
    std::os::unix::fs::symlink(&victim, dir.path().join("b.cache.partial")).unwrap();
    let (a2, b2) = (a.clone(), b.clone());
    within_limit("writing beside a FIFO", move || {
        write_atomically(&a2, b"A").unwrap();
        write_atomically(&b2, b"B").unwrap();
    });
    assert_eq!(std::fs::read(&a).unwrap(), b"A");
    assert_eq!(std::fs::read(&b).unwrap(), b"B");
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
}

#[cfg(unix)]
#[test]
fn an_own_file_replaces_a_symlink_and_refuses_special_files() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    write_atomically(&link, b"new").unwrap();
    assert!(std::fs::symlink_metadata(&link).unwrap().is_file());
    assert_eq!(std::fs::read(&link).unwrap(), b"new");
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"keep me",
        "never followed"
    );

    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let f2 = fifo.clone();
    let e = within_limit("a FIFO as an own file", move || {
        format!("{:#}", write_atomically(&f2, b"x").unwrap_err())
    });
    assert!(e.contains("fifo is a FIFO"), "{e}");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());

    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let e = format!("{:#}", write_atomically(&sub, b"x").unwrap_err());
    assert!(e.contains("sub is a directory"), "{e}");
    assert!(partials_of(&fifo).is_empty() && partials_of(&sub).is_empty());
}

#[cfg(unix)]
#[test]
fn an_output_fifo_is_written_in_place_and_stays_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("out");
    mkfifo(&fifo);
    let f2 = fifo.clone();
    let reader = std::thread::spawn(move || std::fs::read(f2).unwrap());
    let f3 = fifo.clone();
    within_limit("writing a FIFO output", move || {
        write_output(&f3, b"through the pipe").unwrap()
    });
    assert_eq!(reader.join().unwrap(), b"through the pipe");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert!(partials_of(&fifo).is_empty());
}

#[cfg(unix)]
#[test]
fn an_output_device_is_written_in_place() {
    write_output(Path::new("/dev/null"), b"discarded").unwrap();
    let m = std::fs::symlink_metadata("/dev/null").unwrap();
    assert!(
        m.file_type().is_char_device(),
        "/dev/null is still a device"
    );
}

#[cfg(unix)]
#[test]
fn an_output_symlink_is_followed_and_stays_a_link() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target.json");
    std::fs::write(&target, b"old").unwrap();
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    write_output(&link, b"new").unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), b"new");

    // A link to a FIFO (as /dev/stdout is to a pipe) is written in place.
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let to_fifo = dir.path().join("to-fifo");
    std::os::unix::fs::symlink(&fifo, &to_fifo).unwrap();
    let f2 = fifo.clone();
    let reader = std::thread::spawn(move || std::fs::read(f2).unwrap());
    within_limit("a symlink to a FIFO", move || {
        write_output(&to_fifo, b"piped").unwrap()
    });
    assert_eq!(reader.join().unwrap(), b"piped");

    let dangling = dir.path().join("dangling");
    std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
    let e = format!("{:#}", write_output(&dangling, b"x").unwrap_err());
    assert!(e.contains("dangling is a symlink whose target"), "{e}");
}

#[cfg(unix)]
#[test]
fn an_output_that_is_a_directory_or_socket_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let e = format!("{:#}", write_output(dir.path(), b"x").unwrap_err());
    assert!(e.contains("is a directory"), "{e}");
    let sock = dir.path().join("sock");
    let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let e = format!("{:#}", write_output(&sock, b"x").unwrap_err());
    assert!(e.contains("sock is a socket"), "{e}");
}

#[test]
fn temporary_names_read_back() {
    assert_eq!(
        parse_partial("a.k3pc.123.0badf00d.partial"),
        Some(("a.k3pc", Some(123)))
    );
    assert_eq!(
        parse_partial("k3-weights.cache.partial"),
        Some(("k3-weights.cache", None))
    );
    assert_eq!(parse_partial("x.y.partial"), Some(("x.y", None)));
    assert_eq!(
        parse_partial("x.12.nothex!!.partial"),
        Some(("x.12.nothex!!", None))
    );
    assert_eq!(parse_partial(".partial"), None);
    assert_eq!(parse_partial("a.k3pc"), None);
    let dir = tempfile::tempdir().unwrap();
    let t = temp_name(&dir.path().join("n.bin")).unwrap();
    let name = t.file_name().unwrap().to_str().unwrap();
    assert_eq!(
        parse_partial(name),
        Some(("n.bin", Some(std::process::id())))
    );
}

#[cfg(unix)]
#[test]
fn leftovers_of_dead_writers_are_removed_and_live_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k3-weights.cache");
    let put = |name: &str, ago: Duration| {
        let p = dir.path().join(name);
        std::fs::write(&p, b"cut").unwrap();
        age(&p, ago);
        p
    };
    let old = DEAD_WRITER_GRACE + Duration::from_secs(60);
    // No process has a PID above pid_t's range.
    let dead_old = put("k3-weights.cache.4000000000.00000001.partial", old);
    let dead_new = put(
        "k3-weights.cache.4000000000.00000002.partial",
        Duration::ZERO,
    );
    let parent = std::os::unix::process::parent_id();
    let live_old = put(
        &format!("k3-weights.cache.{parent}.00000003.partial"),
        UNKNOWN_WRITER_AGE * 2,
    );
    // This process's PID, but no writer of this process has it open: an earlier
    // process with the same PID left it.
    let own = std::process::id();
    let reused_pid = put(&format!("k3-weights.cache.{own}.00000004.partial"), old);
    let legacy_old = put("k3-weights.cache.partial", UNKNOWN_WRITER_AGE * 2);
    let other = put("other.cache.4000000000.00000005.partial", old);

    let mut removed = remove_leftovers(&path);
    removed.sort();
    let mut want = vec![dead_old, reused_pid, legacy_old];
    want.sort();
    assert_eq!(removed, want);
    for kept in [&dead_new, &live_old, &other] {
        assert!(kept.exists(), "{} was removed", kept.display());
    }

    // A writer of this process is kept however old its file, and starting a writer
    // removes the leftovers first.
    let dead_again = put("k3-weights.cache.4000000000.00000006.partial", old);
    let mut open = AtomicFile::create(&path).unwrap();
    assert!(!dead_again.exists(), "create removes leftovers");
    open.write_all(b"in progress").unwrap();
    let Dest::Rename { tmp: mine, .. } = &open.dest else {
        panic!("an own file is renamed in")
    };
    let mine = mine.clone();
    age(&mine, UNKNOWN_WRITER_AGE * 2);
    assert!(remove_leftovers(&path).is_empty());
    assert!(mine.exists());
    drop(open);
    assert!(!mine.exists());

    // An older name still being written within the hour is kept.
    let legacy_new = put("k3-weights.cache.partial", Duration::ZERO);
    assert!(remove_leftovers(&path).is_empty());
    assert!(legacy_new.exists());
}

#[cfg(target_os = "linux")]
#[test]
fn a_full_device_names_the_file_and_offset() {
    // /dev/full fails every write with ENOSPC, in place as a character device.
    let mut f = AtomicFile::output(Path::new("/dev/full")).unwrap();
    f.out = Some(BufWriter::with_capacity(
        16,
        Sink::File(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap(),
        ),
    ));
    f.write_all(b"0123456789").unwrap();
    let err = f.write_all(b"0123456789abcdef").unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("/dev/full") && msg.contains("at byte 10"),
        "{msg}"
    );
}
