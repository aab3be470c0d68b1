//! Files k3 writes (synthesized shards, the weight cache, prompt-cache entries, usage
//! history, route traces, dumps) go through [`AtomicFile`]: they are written under a
//! temporary name beside their destination and renamed into place only once complete and
//! synced, so a full disk, an error or a killed process never leaves a file under the real
//! name that later loads as valid. Every error names the file and the byte offset it
//! happened at.
//!
//! The temporary is `NAME.PID.RANDOM.partial`, created with `O_CREAT|O_EXCL` (and
//! `O_NOFOLLOW` on Unix; `create_new` elsewhere): a symlink, FIFO or another writer's file
//! at that name is never followed, opened or shared, so creating it never blocks and never
//! writes through a link. Temporaries of writers that are gone are removed when the same
//! destination is written again ([`remove_leftovers`]): on Unix, one whose PID is not a
//! live process and that has not changed for [`DEAD_WRITER_GRACE`]; one whose writer
//! cannot be checked (other systems, older names) once unchanged for [`UNKNOWN_WRITER_AGE`].
//!
//! Two kinds of destination:
//! - k3's own files ([`AtomicFile::create`], [`write_atomically`]): the rename replaces a
//!   regular file or a symlink at the name (the link itself, never what it points to: these
//!   names live in shared directories); a FIFO, device, socket or directory there is refused.
//! - outputs a user names ([`AtomicFile::output`], [`write_output`]: `--stats-json`,
//!   `--dump-logits`, `--route-trace`): `-` is standard output; a FIFO or character device
//!   is written in place, never renamed over; a symlink is followed, as the shell's `>`
//!   follows one: its target is replaced whole (the link stays) or, when it is a FIFO or
//!   device (`/dev/stdout`), written in place. Anything else is refused naming what it is.

use anyhow::{bail, Context, Result};
use std::fs::{File, Metadata, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// Bytes buffered before a write reaches the file.
const BUFFER_BYTES: usize = 8 << 20;

/// The ending of every temporary name.
const SUFFIX: &str = ".partial";

/// A temporary whose writer is not a live process is removed once unchanged this long: a
/// writer on another host or in another PID namespace (a shared directory) keeps writing,
/// which keeps its file younger than this.
pub const DEAD_WRITER_GRACE: Duration = Duration::from_secs(10 * 60);

/// A temporary whose writer cannot be checked (no PID in its name, or a system without the
/// check) is removed once unchanged this long.
pub const UNKNOWN_WRITER_AGE: Duration = Duration::from_secs(60 * 60);

/// Temporaries this process has open: a name with this process's PID and not listed here
/// was left by an earlier process that had the same PID (a container's PID 1).
static OPEN: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn open_list() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    OPEN.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the bytes go: a file, or this process's standard output.
enum Sink {
    File(File),
    Stdout(std::io::Stdout),
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Sink::File(f) => f.write(buf),
            Sink::Stdout(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Sink::File(f) => f.flush(),
            Sink::Stdout(s) => s.flush(),
        }
    }
}

/// How the bytes reach the destination.
enum Dest {
    /// Written under `tmp` beside `target` (the destination, or the file a followed
    /// symlink names) and renamed over `target` at commit.
    Rename { tmp: PathBuf, target: PathBuf },
    /// Written straight into the destination: a FIFO, a character device or `-`.
    InPlace,
}

/// A file being written; [`AtomicFile::commit`] puts it in place. Dropped uncommitted, a
/// renamed file's temporary is removed (bytes already written in place stay written).
pub struct AtomicFile {
    path: PathBuf,
    dest: Dest,
    out: Option<BufWriter<Sink>>,
    written: u64,
}

/// What a file that is neither regular nor a symlink is, for errors.
fn what_is(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "neither a file nor a directory"
}

/// Whether an output of this type is written in place: a FIFO or a character device
/// (`/dev/null`, a terminal), which a rename would replace instead of writing to.
fn written_in_place(meta: &Metadata) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        t.is_fifo() || t.is_char_device()
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        false
    }
}

impl AtomicFile {
    /// Starts writing k3's own file `path` (under a temporary name until committed); a
    /// FIFO, device, socket or directory at `path` is refused.
    pub fn create(path: &Path) -> Result<Self> {
        Self::with_buffer(path, BUFFER_BYTES)
    }

    /// [`AtomicFile::create`] with a write buffer of `bytes` (many files open at once
    /// each take a small one).
    pub fn with_buffer(path: &Path, bytes: usize) -> Result<Self> {
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("inspecting {}", path.display())),
            Ok(m) if m.is_file() || m.file_type().is_symlink() => {}
            Ok(m) => bail!(
                "{} is {}: k3 writes its files only over a regular file or a symlink (the link is replaced, not followed); remove it",
                path.display(),
                what_is(&m)
            ),
        }
        Self::renamed(path, path, bytes)
    }

    /// Starts writing an output the user named: `-` is standard output, a FIFO or a
    /// character device is written in place, a symlink is followed (its target replaced
    /// whole, or written in place when it is a FIFO or device), a regular file or a new
    /// name is written under a temporary name and renamed in. Opening a FIFO waits for its
    /// reader, as the shell's `>` does.
    pub fn output(path: &Path) -> Result<Self> {
        if path.as_os_str() == "-" {
            return Ok(Self::in_place(path, Sink::Stdout(std::io::stdout())));
        }
        let link = match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Self::renamed(path, path, BUFFER_BYTES)
            }
            Err(e) => return Err(e).with_context(|| format!("inspecting {}", path.display())),
            Ok(m) => m,
        };
        let is_link = link.file_type().is_symlink();
        let meta = if is_link {
            std::fs::metadata(path).with_context(|| {
                format!(
                    "{} is a symlink whose target cannot be reached",
                    path.display()
                )
            })?
        } else {
            link
        };
        if meta.is_file() {
            if !is_link {
                return Self::renamed(path, path, BUFFER_BYTES);
            }
            let target = std::fs::canonicalize(path)
                .with_context(|| format!("following the symlink {}", path.display()))?;
            return Self::renamed(path, &target, BUFFER_BYTES);
        }
        if !written_in_place(&meta) {
            bail!(
                "{} is {}: an output goes to a regular file, a FIFO, a character device or `-` (standard output)",
                path.display(),
                what_is(&meta)
            );
        }
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        // The name was looked up before it was opened: what was opened must still be a
        // FIFO or device, never a regular file swapped in, which this would not truncate.
        let now = file
            .metadata()
            .with_context(|| format!("inspecting {}", path.display()))?;
        if !written_in_place(&now) {
            bail!(
                "{} changed while it was opened (now {}); nothing written",
                path.display(),
                if now.is_file() {
                    "a regular file"
                } else {
                    what_is(&now)
                }
            );
        }
        Ok(Self::in_place(path, Sink::File(file)))
    }

    fn in_place(path: &Path, sink: Sink) -> Self {
        Self {
            path: path.to_path_buf(),
            dest: Dest::InPlace,
            out: Some(BufWriter::with_capacity(BUFFER_BYTES, sink)),
            written: 0,
        }
    }

    /// Writes `path` under a new temporary beside `target`, renamed over `target` at commit.
    fn renamed(path: &Path, target: &Path, bytes: usize) -> Result<Self> {
        remove_leftovers(target);
        let (tmp, file) = create_temp(target)?;
        Ok(Self {
            path: path.to_path_buf(),
            dest: Dest::Rename {
                tmp,
                target: target.to_path_buf(),
            },
            out: Some(BufWriter::with_capacity(bytes, Sink::File(file))),
            written: 0,
        })
    }

    /// The destination path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file the bytes are written to now: the temporary, or the destination itself.
    fn writing(&self) -> &Path {
        match &self.dest {
            Dest::Rename { tmp, .. } => tmp,
            Dest::InPlace => &self.path,
        }
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Appends `bytes`; an error names the file and the offset.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<()> {
        let Some(out) = self.out.as_mut() else {
            return Err(self.closed());
        };
        if let Err(e) = out.write_all(bytes) {
            let f = self.writing();
            return Err(e).with_context(|| {
                format!(
                    "writing {} at byte {} (disk full?)",
                    f.display(),
                    reached(f, self.written)
                )
            });
        }
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Flushes and syncs the file, then renames it to its destination (an output written
    /// in place is flushed); on failure the temporary file is removed.
    pub fn commit(mut self) -> Result<u64> {
        let out = self.out.take().ok_or_else(|| self.closed())?;
        let done = self.finish(out);
        self.forget_temp(done.is_err());
        done
    }

    fn finish(&self, out: BufWriter<Sink>) -> Result<u64> {
        let at = self.written;
        let f = self.writing();
        let sink = out.into_inner().map_err(|e| {
            anyhow::Error::new(e.into_error()).context(format!(
                "flushing {} at byte {} of {at} (disk full?)",
                f.display(),
                reached(f, at)
            ))
        })?;
        match (&self.dest, sink) {
            (Dest::Rename { tmp, target }, Sink::File(file)) => {
                file.sync_all()
                    .with_context(|| format!("syncing {} (disk full?)", tmp.display()))?;
                drop(file);
                std::fs::rename(tmp, target).with_context(|| {
                    format!("renaming {} to {}", tmp.display(), target.display())
                })?;
            }
            (Dest::Rename { .. }, Sink::Stdout(_)) => {
                bail!("internal: {} renamed from standard output", f.display())
            }
            (Dest::InPlace, mut s) => {
                s.flush()
                    .with_context(|| format!("flushing {} at byte {at}", f.display()))?;
            }
        }
        Ok(self.written)
    }

    /// Drops the temporary from this process's open list, removing it first when `remove`.
    fn forget_temp(&self, remove: bool) {
        if let Dest::Rename { tmp, .. } = &self.dest {
            if remove {
                let _ = std::fs::remove_file(tmp);
            }
            open_list().retain(|p| p != tmp);
        }
    }

    fn closed(&self) -> anyhow::Error {
        anyhow::anyhow!(
            "internal: {} written after it was closed",
            self.path.display()
        )
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            // Uncommitted: what is buffered is discarded, and the temporary must not
            // outlive the failed write.
            drop(out.into_parts());
            self.forget_temp(true);
        }
    }
}

/// Where a failed write stopped: the bytes that reached `f` (what is buffered had not),
/// or `fallback` when its size cannot be read (`/dev/full`, a FIFO).
fn reached(f: &Path, fallback: u64) -> u64 {
    match std::fs::metadata(f) {
        Ok(m) if m.is_file() => m.len(),
        _ => fallback,
    }
}

/// A new temporary name beside `target`: `NAME.PID.RANDOM.partial`.
fn temp_name(target: &Path) -> Result<PathBuf> {
    let Some(name) = target.file_name() else {
        bail!("{} names no file", target.display());
    };
    let mut name = name.to_os_string();
    name.push(format!(
        ".{}.{:08x}{SUFFIX}",
        std::process::id(),
        rand::random::<u32>()
    ));
    Ok(target.with_file_name(name))
}

/// Creates a temporary beside `target` that did not exist before: `O_CREAT|O_EXCL` (with
/// `O_NOFOLLOW` on Unix), so whatever holds a name already is never opened.
fn create_temp(target: &Path) -> Result<(PathBuf, File)> {
    const TRIES: usize = 8;
    for _ in 0..TRIES {
        let tmp = temp_name(target)?;
        let mut o = OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.custom_flags(libc::O_NOFOLLOW);
        }
        match o.open(&tmp) {
            Ok(f) => {
                open_list().push(tmp.clone());
                return Ok((tmp, f));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", tmp.display())),
        }
    }
    bail!(
        "creating a temporary file beside {}: {TRIES} new names were all taken",
        target.display()
    )
}

/// A temporary's name read back: the destination's file name and the writer's PID (`None`
/// for the older `NAME.partial`, which carries none).
pub fn parse_partial(file_name: &str) -> Option<(&str, Option<u32>)> {
    let stem = file_name.strip_suffix(SUFFIX)?;
    let mut it = stem.rsplitn(3, '.');
    if let (Some(random), Some(pid), Some(dest)) = (it.next(), it.next(), it.next()) {
        let hex = random.len() == 8 && random.bytes().all(|b| b.is_ascii_hexdigit());
        let digits = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
        if hex && digits && !dest.is_empty() {
            if let Ok(p) = pid.parse() {
                return Some((dest, Some(p)));
            }
        }
    }
    (!stem.is_empty()).then_some((stem, None))
}

/// Whether a process `pid` runs on this host: `None` where that cannot be told.
fn process_alive(pid: u32) -> Option<bool> {
    #[cfg(unix)]
    {
        let Ok(p) = libc::pid_t::try_from(pid) else {
            return Some(false);
        };
        if p <= 0 {
            // 0 and negative numbers name process groups, not a writer.
            return None;
        }
        // SAFETY: signal 0 delivers nothing; it only checks that the process exists.
        let r = unsafe { libc::kill(p, 0) };
        // EPERM: it exists under another user.
        Some(r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH))
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        None
    }
}

/// Whether the temporary at `path` (metadata `meta`, writer `pid` from its name) was left
/// by a writer that is gone: see [`DEAD_WRITER_GRACE`] and [`UNKNOWN_WRITER_AGE`].
pub fn is_abandoned(path: &Path, pid: Option<u32>, meta: &Metadata) -> bool {
    let age = meta
        .modified()
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .unwrap_or(Duration::ZERO);
    let alive = match pid {
        Some(p) if p == std::process::id() => Some(open_list().iter().any(|o| o == path)),
        Some(p) => process_alive(p),
        None => None,
    };
    match alive {
        Some(true) => false,
        Some(false) => age >= DEAD_WRITER_GRACE,
        None => age >= UNKNOWN_WRITER_AGE,
    }
}

/// The temporaries of every writer of `target` in its directory, with their writer's PID.
fn partials(target: &Path) -> Vec<(PathBuf, Option<u32>, Metadata)> {
    let Some(name) = target.file_name().and_then(|n| n.to_str()) else {
        return Vec::new();
    };
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| {
        let e = e.ok()?;
        let file_name = e.file_name();
        let (dest, pid) = parse_partial(file_name.to_str()?)?;
        (dest == name).then_some(())?;
        let meta = std::fs::symlink_metadata(e.path()).ok()?;
        Some((e.path(), pid, meta))
    })
    .collect()
}

/// The temporaries of every writer of `target` (this process's, others', abandoned ones).
pub fn partials_of(target: &Path) -> Vec<PathBuf> {
    partials(target).into_iter().map(|p| p.0).collect()
}

/// Removes the temporaries of `target` that writers left behind ([`is_abandoned`]);
/// returns those removed. Failures are skipped: the next write tries again.
pub fn remove_leftovers(target: &Path) -> Vec<PathBuf> {
    partials(target)
        .into_iter()
        .filter(|(p, pid, meta)| is_abandoned(p, *pid, meta) && std::fs::remove_file(p).is_ok())
        .map(|p| p.0)
        .collect()
}

/// Writes k3's own file `path` through a temporary name and a rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit().map(|_| ())
}

/// Writes the output `path` a user named ([`AtomicFile::output`]: `-`, FIFOs and devices
/// in place, symlinks followed, files replaced whole).
pub fn write_output(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::output(path)?;
    f.write_all(bytes)?;
    f.commit().map(|_| ())
}

#[cfg(test)]
mod tests;
