//! Expert reads the loader pool splits into pieces that several threads read at once
//! (`experts/piece_read.rs`): the bytes equal a whole read's in both I/O modes, a short or
//! interrupted piece read changes nothing, and an I/O error in one piece gives the same
//! clear error as in a whole read, naming the shard file and the offset.

use crate::support;

use support::read_faults::{expert_parts, ErrorAt, ShortReads};

use k3::checkpoint::Checkpoint;
use k3::experts::{ExpertReader, ExpertSource, IoMode, StreamConfig};
use k3::stats::Stats;
use std::io::ErrorKind;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// One block: the smallest piece, so every expert that spans two blocks splits.
const PIECE: usize = 4096;

/// The first MoE layer and its experts in canonical order, with at least one expert that
/// splits into pieces of [`PIECE`] bytes (else the tests here could not fail).
fn layer_and_ids(ck: &Checkpoint) -> (usize, Vec<u32>) {
    let layer = (0..ck.config.num_hidden_layers)
        .find(|&l| ExpertReader::locate(ck, l, 0).is_ok())
        .unwrap();
    let mut ids: Vec<u32> = (0..ck.config.num_experts as u32).collect();
    ExpertSource::canonical_order(ck, layer, &mut ids).unwrap();
    let splits = ids
        .iter()
        .filter(|&&e| {
            let s = ExpertReader::locate(ck, layer, e).unwrap().span();
            (s.end.div_ceil(4096) - s.start / 4096) as usize * 4096 > PIECE
        })
        .count();
    assert!(splits > 0, "no expert of the tiny model spans two blocks");
    (layer, ids)
}

fn source(mode: IoMode, piece: usize) -> ExpertSource {
    let src = ExpertSource::new(StreamConfig {
        mode,
        pipe: true,
        load_threads: 3,
        slots_per_layer: 0,
    })
    .unwrap();
    src.set_read_piece(piece);
    src
}

/// Streams `ids` of `layer` through `src`: each expert's id and tensors, in order.
fn stream(
    src: &ExpertSource,
    ck: &Checkpoint,
    layer: usize,
    ids: &[u32],
) -> anyhow::Result<Vec<(u32, Vec<Vec<u8>>)>> {
    let mut got = Vec::new();
    src.stream(
        ck,
        layer,
        ids,
        &vec![false; ids.len()],
        &mut Stats::default(),
        &mut || Ok(()),
        &mut |batch| {
            for s in batch {
                match s {
                    k3::experts::Supplied::Host(e) => got.push((e.id, expert_parts(e, ck))),
                    k3::experts::Supplied::Resident(id) => panic!("expert {id} resident"),
                }
            }
            Ok(())
        },
    )?;
    Ok(got)
}

fn whole_reads(ck: &Checkpoint, layer: usize, ids: &[u32]) -> Vec<(u32, Vec<Vec<u8>>)> {
    let r = ExpertReader::new(IoMode::Buffered);
    ids.iter()
        .map(|&e| (e, expert_parts(&r.read(ck, layer, e).unwrap(), ck)))
        .collect()
}

#[test]
fn split_reads_give_the_bytes_of_a_whole_read() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, ids) = layer_and_ids(&ck);
    let want = whole_reads(&ck, layer, &ids);
    for mode in [IoMode::Direct, IoMode::Buffered] {
        for piece in [PIECE, 3 * PIECE, 0] {
            let src = source(mode, piece);
            // Twice: the second pass finds the pool's threads warm and its queues empty.
            for pass in 0..2 {
                let got = stream(&src, &ck, layer, &ids).unwrap();
                assert_eq!(got, want, "{mode:?} piece {piece} pass {pass}");
            }
            let (_, bytes) = src.disk_totals();
            let expert_bytes: u64 = ids
                .iter()
                .map(|&e| ExpertReader::locate(&ck, layer, e).unwrap().byte_len())
                .sum();
            assert_eq!(
                bytes,
                2 * expert_bytes,
                "{mode:?} piece {piece}: bytes counted"
            );
        }
    }
}

/// An expert of `ids` whose last byte lies in a later block than its first: its read
/// splits, and the piece holding its last byte is not the first.
fn split_expert(ck: &Checkpoint, layer: usize, ids: &[u32]) -> u32 {
    *ids.iter()
        .find(|&&e| {
            let s = ExpertReader::locate(ck, layer, e).unwrap().span();
            (s.end - 1) / 4096 > s.start / 4096
        })
        .unwrap()
}

#[test]
fn an_io_error_in_one_piece_names_the_shard_and_the_offset() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, ids) = layer_and_ids(&ck);
    let e = split_expert(&ck, layer, &ids);
    let loc = ExpertReader::locate(&ck, layer, e).unwrap().clone();
    let span = loc.span();
    // The expert's last byte: it lies in the last piece, not the one the read starts with.
    let at = span.end - 1;
    for mode in [IoMode::Direct, IoMode::Buffered] {
        let src = source(mode, PIECE);
        src.inject_faults(Arc::new(ErrorAt {
            at,
            kind: ErrorKind::Other,
            left: AtomicUsize::new(usize::MAX),
        }))
        .unwrap();
        let err = match stream(&src, &ck, layer, &[e]) {
            Ok(_) => panic!("{mode:?}: an expert read through an I/O error"),
            Err(err) => format!("{err:#}"),
        };
        let shard = ck.shard_path(loc.shard).display().to_string();
        assert!(err.contains(&shard), "{mode:?}: {err}");
        assert!(err.contains("injected fault"), "{mode:?}: {err}");
        assert!(
            err.contains(&format!("expert {e} of layer {layer}")),
            "{mode:?}: {err}"
        );
        let off: u64 = err
            .split("at offset ")
            .nth(1)
            .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{mode:?}: no offset in {err}"));
        // The failing piece starts at the block that holds `at`, after the expert's first.
        assert!(off <= at && at - off < PIECE as u64, "{off} {at}: {err}");
        assert!(
            off > span.start,
            "{off}: the failing piece is not the first: {err}"
        );
    }
}

#[test]
fn short_and_interrupted_piece_reads_give_the_bytes_of_a_whole_read() {
    let ck = Checkpoint::open(&support::tiny(0), &[]).unwrap();
    let (layer, ids) = layer_and_ids(&ck);
    let want = whole_reads(&ck, layer, &ids);
    for mode in [IoMode::Direct, IoMode::Buffered] {
        for max in [1usize, 777, 4096] {
            let src = source(mode, PIECE);
            src.inject_faults(Arc::new(ShortReads::new(max))).unwrap();
            let got = stream(&src, &ck, layer, &ids).unwrap();
            assert_eq!(got, want, "{mode:?} short reads of {max}");
        }
        let e = split_expert(&ck, layer, &ids);
        let span = ExpertReader::locate(&ck, layer, e).unwrap().span();
        let src = source(mode, PIECE);
        src.inject_faults(Arc::new(ErrorAt {
            at: span.end - 1,
            kind: ErrorKind::Interrupted,
            left: AtomicUsize::new(3),
        }))
        .unwrap();
        let got = stream(&src, &ck, layer, &[e]).unwrap();
        let want_e: Vec<_> = want.iter().filter(|(id, _)| *id == e).cloned().collect();
        assert_eq!(got, want_e, "{mode:?} after EINTR");
    }
}
