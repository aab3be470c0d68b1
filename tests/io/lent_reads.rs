//! Expert reads into memory a backend lends (`ReadLender`): the bytes match a plain read, a
//! lender with nothing free leaves the read in host memory, and a region the read cannot
//! use sends it back to host memory and stops the lender.

use crate::support;

use support::read_faults::expert_parts;

use k3::checkpoint::Checkpoint;
use k3::experts::{ExpertReader, IoMode};
use k3::platform::aligned_buf::AlignedBuf;
use k3::routed_expert::{LentRegion, ReadLender};
use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Lends host buffers, or a one-byte region (`broken`), or nothing (`empty`).
#[derive(Default)]
struct TestLender {
    broken: bool,
    empty: bool,
    lent: AtomicUsize,
    refusals: Mutex<Vec<String>>,
}

struct TestRegion {
    buf: AlignedBuf,
    broken: bool,
}

impl LentRegion for TestRegion {
    fn bytes_mut(&mut self) -> &mut [u8] {
        let whole = self.buf.block_region_mut();
        if self.broken {
            &mut whole[..1]
        } else {
            whole
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl ReadLender for TestLender {
    fn lend(&self, len: usize) -> Option<Box<dyn LentRegion>> {
        if self.empty || !self.refusals.lock().unwrap().is_empty() {
            return None;
        }
        self.lent.fetch_add(1, Ordering::Relaxed);
        Some(Box::new(TestRegion {
            buf: AlignedBuf::new(len),
            broken: self.broken,
        }))
    }
    fn refuse(&self, why: &str) {
        self.refusals.lock().unwrap().push(why.to_string());
    }
}

/// The first MoE layer of the checkpoint and its expert count.
fn moe_layer(ck: &Checkpoint) -> (usize, u32) {
    let layer = (0..ck.config.num_hidden_layers)
        .find(|&l| ExpertReader::locate(ck, l, 0).is_ok())
        .unwrap();
    (layer, ck.config.num_experts as u32)
}

#[test]
fn lent_reads_hold_the_bytes_a_plain_read_gives() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, n) = moe_layer(&ck);
    for mode in [IoMode::Direct, IoMode::Buffered] {
        let lender = Arc::new(TestLender::default());
        let lent = ExpertReader::new(mode).with_lender(Some(lender.clone()));
        let plain = ExpertReader::new(mode);
        for e in 0..n {
            let a = lent.read(&ck, layer, e).unwrap();
            let b = plain.read(&ck, layer, e).unwrap();
            let st = a.staged(&ck.config).expect("read into the lent region");
            assert!(
                a.weights(&ck.config).is_err(),
                "no host views of lent bytes"
            );
            let region = st.region.downcast_ref::<TestRegion>().unwrap();
            let want = expert_parts(&b, &ck);
            for (k, r) in st.parts.iter().enumerate() {
                let got = &region.buf[r.start as usize..r.end as usize];
                assert_eq!(got, &want[k][..], "{mode:?} expert {e} tensor {k}");
            }
        }
        assert_eq!(lender.lent.load(Ordering::Relaxed), n as usize);
    }
}

#[test]
fn no_region_free_or_a_broken_one_reads_into_host_memory() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, n) = moe_layer(&ck);
    let plain = ExpertReader::new(IoMode::Buffered);
    for (broken, empty) in [(false, true), (true, false)] {
        let lender = Arc::new(TestLender {
            broken,
            empty,
            ..Default::default()
        });
        let r = ExpertReader::new(IoMode::Buffered).with_lender(Some(lender.clone()));
        for e in 0..n {
            let a = r.read(&ck, layer, e).unwrap();
            assert!(
                a.staged(&ck.config).is_none(),
                "expert {e} should be in host memory"
            );
            let b = plain.read(&ck, layer, e).unwrap();
            let (wa, wb) = (
                a.weights(&ck.config).unwrap(),
                b.weights(&ck.config).unwrap(),
            );
            assert_eq!(wa.w2.packed, wb.w2.packed);
            assert_eq!(wa.w3.scales, wb.w3.scales);
        }
        let refusals = lender.refusals.lock().unwrap().clone();
        if broken {
            // Refused once, after the first read, with the reason; none lent after that.
            assert_eq!(refusals.len(), 1, "{refusals:?}");
            assert!(refusals[0].contains("read destination"), "{refusals:?}");
            assert_eq!(lender.lent.load(Ordering::Relaxed), 1);
        } else {
            assert!(refusals.is_empty());
        }
    }
}

/// Streams every expert of `layer` through a piped source with `lender` whose reads split
/// into one-block pieces: for each expert, its six tensors as read (from the lent region or
/// host memory) and whether it was read into a lent region.
fn split_stream(
    ck: &Checkpoint,
    layer: usize,
    lender: Arc<TestLender>,
) -> Vec<(u32, Vec<Vec<u8>>, bool)> {
    use k3::experts::{ExpertSource, StreamConfig, Supplied};
    let src = ExpertSource::with_lender(
        StreamConfig {
            mode: IoMode::Direct,
            pipe: true,
            load_threads: 3,
            slots_per_layer: 0,
        },
        Some(lender),
    )
    .unwrap();
    src.set_read_piece(4096);
    let mut ids: Vec<u32> = (0..ck.config.num_experts as u32).collect();
    ExpertSource::canonical_order(ck, layer, &mut ids).unwrap();
    let mut got = Vec::new();
    src.stream(
        ck,
        layer,
        &ids,
        &vec![false; ids.len()],
        &mut k3::stats::Stats::default(),
        &mut || Ok(()),
        &mut |batch| {
            for s in batch {
                let Supplied::Host(e) = s else {
                    panic!("no tier here")
                };
                let tensors = match e.staged(&ck.config) {
                    Some(st) => {
                        let region = st.region.downcast_ref::<TestRegion>().unwrap();
                        st.parts
                            .iter()
                            .map(|r| region.buf[r.start as usize..r.end as usize].to_vec())
                            .collect()
                    }
                    None => expert_parts(e, ck),
                };
                got.push((e.id, tensors, e.staged(&ck.config).is_some()));
            }
            Ok(())
        },
    )
    .unwrap();
    got
}

#[test]
fn split_reads_into_lent_memory_hold_the_bytes_and_a_broken_region_goes_to_host_memory() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, n) = moe_layer(&ck);
    let plain = ExpertReader::new(IoMode::Buffered);
    let want = |e: u32| expert_parts(&plain.read(&ck, layer, e).unwrap(), &ck);
    for broken in [false, true] {
        let lender = Arc::new(TestLender {
            broken,
            ..Default::default()
        });
        let got = split_stream(&ck, layer, lender.clone());
        assert_eq!(got.len(), n as usize);
        for (e, tensors, lent) in got {
            assert_eq!(tensors, want(e), "broken {broken}: expert {e}");
            // A broken region holds one byte: every read into it fails and is done again
            // in host memory.
            assert_eq!(lent, !broken, "broken {broken}: expert {e}");
        }
        let refusals = lender.refusals.lock().unwrap().clone();
        if broken {
            // Refused by each read lent a region before the first refusal (the loader
            // threads' reads in flight then), split or whole, each naming the destination;
            // none lent after that.
            assert!(!refusals.is_empty(), "{refusals:?}");
            assert!(
                refusals.iter().all(|r| r.contains("read destination")),
                "{refusals:?}"
            );
            assert_eq!(lender.lent.load(Ordering::Relaxed), refusals.len());
        } else {
            assert!(refusals.is_empty(), "{refusals:?}");
        }
    }
}
