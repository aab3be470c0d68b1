//! Faults in the expert read path: I/O errors and short reads injected through the reader
//! ([`FaultPlan`]), shards truncated, replaced or deleted while experts stream, and corrupt
//! scales in memory a backend lent. Each gives an error naming the file and offset, or
//! (for a short or interrupted read) the same bytes as a clean read; never an expert
//! computed from wrong bytes.

use crate::support;

use support::read_faults::{expert_parts, ErrorAt, ShortReads};

use k3::checkpoint::Checkpoint;
use k3::experts::{ExpertReader, FaultPlan, IoMode, ReadFault, StreamConfig};
use k3::generate::prefill;
use k3::model::FormatPolicy;
use k3::platform::aligned_buf::AlignedBuf;
use k3::routed_expert::{LentRegion, ReadLender};
use k3::stats::Stats;
use std::any::Any;
use std::io::ErrorKind;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const PROMPT: [u32; 6] = [768, 5, 300, 17, 999, 42];

/// The first MoE layer of the checkpoint and its expert count.
fn moe_layer(ck: &Checkpoint) -> (usize, u32) {
    let layer = (0..ck.config.num_hidden_layers)
        .find(|&l| ExpertReader::locate(ck, l, 0).is_ok())
        .unwrap();
    (layer, ck.config.num_experts as u32)
}

#[test]
fn an_io_error_mid_expert_names_the_file_and_offset() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, _) = moe_layer(&ck);
    let loc = ExpertReader::locate(&ck, layer, 1).unwrap().clone();
    let span = loc.span();
    // A byte in the middle of the expert, away from the block its read starts at.
    let at = span.start + (span.end - span.start) * 3 / 4;
    for mode in [IoMode::Buffered, IoMode::Direct] {
        for short in [false, true] {
            let r = ExpertReader::new(mode);
            if short {
                // Short reads first, so the failing read starts at an offset of its own.
                struct Both(ShortReads, ErrorAt);
                impl FaultPlan for Both {
                    fn fault(&self, p: &Path, o: u64, l: usize) -> Option<ReadFault> {
                        self.1.fault(p, o, l).or_else(|| self.0.fault(p, o, l))
                    }
                }
                r.inject_faults(Arc::new(Both(
                    ShortReads {
                        max: 4096,
                        seen: AtomicUsize::new(0),
                    },
                    ErrorAt {
                        at,
                        kind: ErrorKind::Other,
                        left: AtomicUsize::new(usize::MAX),
                    },
                )))
                .unwrap();
            } else {
                r.inject_faults(Arc::new(ErrorAt {
                    at,
                    kind: ErrorKind::Other,
                    left: AtomicUsize::new(usize::MAX),
                }))
                .unwrap();
            }
            let e = match r.read(&ck, layer, 1) {
                Ok(_) => panic!("{mode:?}: an expert read through an I/O error"),
                Err(e) => format!("{e:#}"),
            };
            let shard = ck.shard_path(loc.shard).display().to_string();
            assert!(e.contains(&shard), "{mode:?}: {e}");
            assert!(e.contains("injected fault"), "{mode:?}: {e}");
            assert!(e.contains("expert 1 of layer"), "{mode:?}: {e}");
            // The offset named is the failing read's: inside the expert, at or before `at`.
            let off: u64 = e
                .split("at offset ")
                .nth(1)
                .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{mode:?}: no offset in {e}"));
            // (A direct read starts at the block that holds the expert's first byte.)
            assert!(off <= at && off + 4096 > span.start, "{off} {at}: {e}");
            if short {
                // Reads of 4096 bytes: the failing one starts within two blocks of `at`.
                assert!(
                    at - off < 8192,
                    "short reads: the failing one starts later: {e}"
                );
            }
        }
    }
}

#[test]
fn short_and_interrupted_reads_give_the_bytes_of_a_clean_read() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, n) = moe_layer(&ck);
    let clean = ExpertReader::new(IoMode::Buffered);
    for mode in [IoMode::Buffered, IoMode::Direct] {
        for max in [1usize, 777, 4096, 5000] {
            let plan = Arc::new(ShortReads {
                max,
                seen: AtomicUsize::new(0),
            });
            let r = ExpertReader::new(mode);
            r.inject_faults(plan.clone()).unwrap();
            for e in 0..n.min(3) {
                let got = r.read(&ck, layer, e).unwrap();
                let want = clean.read(&ck, layer, e).unwrap();
                assert_eq!(
                    expert_parts(&got, &ck),
                    expert_parts(&want, &ck),
                    "{mode:?} max {max} expert {e}"
                );
            }
            let seen = plan.seen.load(Ordering::Relaxed);
            assert!(seen >= 3, "the faults were consulted: {seen}");
            if max == 1 {
                // One byte per read: at least as many reads as the experts' bytes.
                let bytes: u64 = (0..3)
                    .map(|e| ExpertReader::locate(&ck, layer, e).unwrap().byte_len())
                    .sum();
                assert!(seen as u64 >= bytes, "{seen} reads of {bytes} bytes");
            }
        }
        // An interrupted read (EINTR) is retried, not reported.
        let r = ExpertReader::new(mode);
        let loc = ExpertReader::locate(&ck, layer, 0).unwrap();
        r.inject_faults(Arc::new(ErrorAt {
            at: loc.span().start,
            kind: ErrorKind::Interrupted,
            left: AtomicUsize::new(3),
        }))
        .unwrap();
        let got = r.read(&ck, layer, 0).unwrap();
        let want = clean.read(&ck, layer, 0).unwrap();
        assert_eq!(
            expert_parts(&got, &ck),
            expert_parts(&want, &ck),
            "{mode:?} after EINTR"
        );
    }
}

#[test]
fn a_read_that_ends_early_everywhere_is_reported_as_truncation() {
    // Every read reports 0 bytes: what a file cut short at the expert looks like.
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, _) = moe_layer(&ck);
    let loc = ExpertReader::locate(&ck, layer, 0).unwrap().clone();
    for mode in [IoMode::Buffered, IoMode::Direct] {
        let r = ExpertReader::new(mode);
        r.inject_faults(Arc::new(ShortReads {
            max: 0,
            seen: AtomicUsize::new(0),
        }))
        .unwrap();
        let e = format!(
            "{:#}",
            r.read(&ck, layer, 0).err().expect("read of nothing")
        );
        assert!(
            e.contains(&ck.shard_path(loc.shard).display().to_string()),
            "{e}"
        );
        assert!(e.contains("the file ends at offset"), "{mode:?}: {e}");
    }
}

fn stream(mode: IoMode, pipe: bool) -> StreamConfig {
    StreamConfig {
        mode,
        pipe,
        load_threads: 2,
        slots_per_layer: 0,
    }
}

fn shards(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// True when the shard at `p` holds routed experts and no dense tensor the run reads
/// through the checkpoint's own map (the embedding rows): its faults reach the expert path.
fn experts_only(p: &Path) -> bool {
    let bytes = std::fs::read(p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + n]);
    header.contains(".experts.") && !header.contains("embed_tokens")
}

/// Loads the tiny model, runs `spoil` on each shard that holds only experts, then
/// prefills: the error, if any.
fn prefill_after(sc: StreamConfig, spoil: impl Fn(&Path)) -> Option<String> {
    let copy = support::copy_dir(&support::tiny(0));
    let m = support::cpu_model(copy.path(), FormatPolicy::default(), sc);
    let spoilt: Vec<_> = shards(copy.path())
        .into_iter()
        .filter(|p| experts_only(p))
        .collect();
    assert!(!spoilt.is_empty());
    spoilt.iter().for_each(|p| spoil(p));
    let mut st = m.new_state().unwrap();
    prefill(&m, &mut st, &PROMPT, 32, false, &mut Stats::default(), None)
        .err()
        .map(|e| format!("{e:#}"))
}

#[test]
fn a_shard_truncated_while_experts_stream_is_reported_with_file_and_offset() {
    for (mode, pipe) in [(IoMode::Buffered, false), (IoMode::Direct, true)] {
        let msg = prefill_after(stream(mode, pipe), |p| {
            let len = std::fs::metadata(p).unwrap().len();
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(len / 2)
                .unwrap();
        })
        .expect("a run over truncated shards succeeded");
        assert!(msg.contains(".safetensors"), "{msg}");
        assert!(msg.contains("offset"), "{msg}");
        assert!(
            msg.contains("the file ends at offset") || msg.contains("changed while k3 was running"),
            "{mode:?}: {msg}"
        );
    }
}

#[test]
fn a_shard_replaced_while_experts_stream_is_reported() {
    support::where_open_files_can_be_replaced(crate::REPLACED_WHILE_OPEN, || {
        for (mode, pipe) in [(IoMode::Buffered, false), (IoMode::Direct, true)] {
            let msg = prefill_after(stream(mode, pipe), |p| {
                // A new file renamed over the old one (what a re-download does): the same
                // length, other bytes, another modification time.
                let mut bytes = std::fs::read(p).unwrap();
                let n = bytes.len();
                bytes[n - 64..].fill(0x11);
                let tmp = p.with_extension("new");
                std::fs::write(&tmp, &bytes).unwrap();
                let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
                std::fs::File::options()
                    .write(true)
                    .open(&tmp)
                    .unwrap()
                    .set_modified(later)
                    .unwrap();
                std::fs::rename(&tmp, p).unwrap();
            })
            .expect("a run over replaced shards succeeded");
            assert!(msg.contains(".safetensors"), "{msg}");
            assert!(
                msg.contains("changed while k3 was running"),
                "{mode:?}: {msg}"
            );
        }
    });
}

#[test]
fn a_shard_deleted_while_experts_stream_is_reported_with_the_file() {
    support::where_open_files_can_be_replaced(crate::REPLACED_WHILE_OPEN, || {
        for (mode, pipe) in [(IoMode::Buffered, false), (IoMode::Direct, true)] {
            let msg = prefill_after(stream(mode, pipe), |p| std::fs::remove_file(p).unwrap())
                .expect("a run over deleted shards succeeded");
            assert!(msg.contains(".safetensors"), "{msg}");
            // A shard the reader had not opened yet cannot be opened; one it holds open
            // would still read its old bytes (the file lives on until closed).
            assert!(msg.contains("opening expert shard"), "{mode:?}: {msg}");
        }
    });
}

/// Lends host buffers, as a GPU's host-memory upload staging would.
#[derive(Default)]
struct HostLender {
    lent: AtomicUsize,
}

struct HostRegion(AlignedBuf);

impl LentRegion for HostRegion {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.block_region_mut()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl ReadLender for HostLender {
    fn lend(&self, len: usize) -> Option<Box<dyn LentRegion>> {
        self.lent.fetch_add(1, Ordering::Relaxed);
        Some(Box::new(HostRegion(AlignedBuf::new(len))))
    }
    fn refuse(&self, why: &str) {
        panic!("refused: {why}");
    }
}

#[test]
fn a_nan_scale_read_into_lent_memory_is_reported_with_the_tensor() {
    let copy = support::copy_dir(&support::tiny(0));
    let ck = Checkpoint::open(copy.path(), &[]).unwrap();
    let (layer, _) = moe_layer(&ck);
    let loc = ExpertReader::locate(&ck, layer, 2).unwrap().clone();
    assert!(loc.contiguous, "the tiny model's experts are contiguous");
    let path = ck.shard_path(loc.shard).to_path_buf();
    drop(ck);
    // One E8M0 scale byte of w2 set to 255 (NaN).
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[loc.parts[3].start as usize + 5] = 0xFF;
    std::fs::write(&path, &bytes).unwrap();
    let ck = Checkpoint::open(copy.path(), &[]).unwrap();
    for mode in [IoMode::Buffered, IoMode::Direct] {
        let lender = Arc::new(HostLender::default());
        let r = ExpertReader::new(mode).with_lender(Some(lender.clone()));
        // Its neighbours read into lent memory as usual.
        assert!(r.read(&ck, layer, 1).unwrap().staged(&ck.config).is_some());
        let e = format!(
            "{:#}",
            r.read(&ck, layer, 2)
                .err()
                .expect("a NaN scale was lent on")
        );
        assert!(e.contains(&path.display().to_string()), "{e}");
        assert!(
            e.contains("E8M0 reserves for NaN") && e.contains("scale byte 5"),
            "{e}"
        );
        assert!(e.contains("w2"), "{mode:?}: {e}");
        assert!(e.contains("expert 2 of layer"), "{e}");
        assert_eq!(lender.lent.load(Ordering::Relaxed), 2);
    }
}
