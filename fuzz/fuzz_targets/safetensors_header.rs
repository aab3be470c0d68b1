//! A shard's bytes: the header length, the JSON header and the tensor entries it
//! describes are validated against the file; any input is an error or a table.
#![no_main]

use std::collections::HashMap;
use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut entries = HashMap::new();
    if k3::checkpoint::shards::parse_header(0, data, Path::new("fuzz.safetensors"), &mut entries)
        .is_ok()
    {
        for e in entries.values() {
            // Every accepted range lies inside the file.
            assert!(e.range.start <= e.range.end && e.range.end <= data.len() as u64);
        }
        // No two accepted tensors share a byte (seeds: seed-overlapping-ranges,
        // seed-duplicate-tensor).
        let mut ranges: Vec<_> = entries
            .values()
            .map(|e| e.range.clone())
            .filter(|r| !r.is_empty())
            .collect();
        ranges.sort_by_key(|r| (r.start, r.end));
        for w in ranges.windows(2) {
            assert!(w[0].end <= w[1].start, "accepted overlapping ranges {w:?}");
        }
    }
});
