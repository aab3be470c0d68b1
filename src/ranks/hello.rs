//! What each rank tells the head at start: where it runs, how it was started, which
//! checkpoint it opened (each file's content identity), or why it could not start. The head
//! refuses a job whose ranks disagree, naming the rank, its host and the file or flag.

use crate::checkpoint::shards::INDEX_FILE;
use crate::checkpoint::{Checkpoint, CONFIG_FILE};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

/// A rank's start-up report.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Hello {
    /// The rank.
    pub rank: usize,
    /// Its host.
    pub host: String,
    /// Its process id (to find it in a process list).
    pub pid: u32,
    /// Its command line after the program name.
    pub args: Vec<String>,
    /// Each checkpoint file's name and content identity: `config.json` first, then the shards.
    pub files: Vec<(String, u64)>,
    /// Its backend line.
    pub backend: String,
    /// Why it could not start, when it could not.
    pub error: Option<String>,
}

/// The content identity of `ck`'s files: the config's and the index's bytes and each
/// opened shard's sampled hash (header and sampled blocks, as the weight cache keys them),
/// by file name, so two hosts holding the same snapshot at different paths agree. A rank
/// opens only its own shards, so two ranks list the shards they share.
pub fn checkpoint_files(ck: &Checkpoint) -> Vec<(String, u64)> {
    let config = std::fs::read(ck.dir.join(CONFIG_FILE)).map_or(0, |b| xxh3_64(&b));
    let mut files = vec![(CONFIG_FILE.to_string(), config)];
    if let Ok(b) = std::fs::read(ck.dir.join(INDEX_FILE)) {
        files.push((INDEX_FILE.to_string(), xxh3_64(&b)));
    }
    for i in 0..ck.shard_count() {
        let name = ck.shard_path(i).file_name().map_or_else(
            || format!("shard {i}"),
            |n| n.to_string_lossy().into_owned(),
        );
        files.push((name, ck.shard_sampled(i)));
    }
    files
}

/// This process's command line after the program name.
pub fn own_args() -> Vec<String> {
    std::env::args().skip(1).collect()
}

/// Checks a rank's report against the head's: an error it reports, another checkpoint or
/// other flags stop the job, named by rank, host and file or flag.
pub fn check(head: &Hello, rank: &Hello) -> Result<()> {
    let who = format!(
        "rank {} on host {} (pid {})",
        rank.rank, rank.host, rank.pid
    );
    if let Some(e) = &rank.error {
        bail!("{who} could not start: {e}");
    }
    if rank.args != head.args {
        let at = rank
            .args
            .iter()
            .zip(&head.args)
            .position(|(a, b)| a != b)
            .unwrap_or(rank.args.len().min(head.args.len()));
        bail!(
            "{who} was started with other flags than the head: `{}` where the head has `{}` (every rank takes the same command line; per-rank settings go in environment variables such as K3_DIRS)",
            rank.args.get(at).map_or("(nothing)", String::as_str),
            head.args.get(at).map_or("(nothing)", String::as_str),
        );
    }
    let find = |h: &'_ Hello, name: &str| h.files.iter().find(|(n, _)| n == name).map(|f| f.1);
    // The config and the index both hold; each shard only where both ranks opened it.
    for name in [CONFIG_FILE, INDEX_FILE] {
        match (find(head, name), find(rank, name)) {
            (Some(a), Some(b)) if a != b => bail!(
                "{who} runs a different checkpoint: its {name} differs from the head's (copy the same snapshot's files to every host)"
            ),
            (Some(_), None) => bail!("{who} runs a different checkpoint: it has no {name}"),
            (None, Some(_)) => bail!("{who} runs a different checkpoint: it has a {name}, the head has none"),
            _ => {}
        }
    }
    for (name, id) in &head.files {
        if let Some(other) = find(rank, name) {
            if other != *id {
                bail!(
                    "{who} runs a different checkpoint: its {name} differs from the head's (content stamps differ; copy the same snapshot to every host)"
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(rank: usize) -> Hello {
        Hello {
            rank,
            host: "h".into(),
            pid: 1,
            args: vec!["run".into(), "m".into()],
            files: vec![("config.json".into(), 1), ("a.safetensors".into(), 2)],
            backend: "cpu".into(),
            error: None,
        }
    }

    #[test]
    fn ranks_that_differ_are_refused_by_name() {
        let head = hello(0);
        check(&head, &hello(1)).unwrap();
        let mut r = hello(1);
        r.files[1].1 = 3;
        let e = check(&head, &r).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 on host h") && e.contains("a.safetensors"),
            "{e}"
        );
        let mut r = hello(2);
        r.args[1] = "other".into();
        let e = check(&head, &r).unwrap_err().to_string();
        assert!(e.contains("rank 2") && e.contains("`other`"), "{e}");
        let mut r = hello(1);
        r.error = Some("shard x.safetensors: not found".into());
        let e = check(&head, &r).unwrap_err().to_string();
        assert!(
            e.contains("could not start") && e.contains("x.safetensors"),
            "{e}"
        );
    }

    #[test]
    fn ranks_compare_only_the_shards_both_opened() {
        let mut head = hello(0);
        head.files.push((INDEX_FILE.into(), 7));
        head.files.push(("dense.safetensors".into(), 9));
        let mut r = hello(1);
        r.files.push((INDEX_FILE.into(), 7));
        r.files.push(("b.safetensors".into(), 4));
        // Shards only one rank opened are not compared; the shared one matches.
        check(&head, &r).unwrap();
        // Another index, or none, is another checkpoint.
        r.files[2].1 = 8;
        let e = check(&head, &r).unwrap_err().to_string();
        assert!(
            e.contains("different checkpoint") && e.contains(INDEX_FILE),
            "{e}"
        );
        r.files.remove(2);
        let e = check(&head, &r).unwrap_err().to_string();
        assert!(e.contains("has no") && e.contains(INDEX_FILE), "{e}");
        // Another config is another checkpoint.
        let mut r = hello(1);
        r.files.push((INDEX_FILE.into(), 7));
        r.files[0].1 = 5;
        let e = check(&head, &r).unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
    }
}
