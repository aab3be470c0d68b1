//! Files the engine reads and writes while it runs: the weight cache, the prompt cache,
//! expert reads (lent, split, faulted), disk and size limits, shards that change
//! underneath, `k3 bench reader`, the cache-policy simulator.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test io NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod bench_reader;
mod fault_disk;
mod fault_limits;
mod fault_reads;
mod lent_reads;
mod prompt_cache;
mod shard_faults;
mod split_reads;
mod weight_cache;
// Lab code only (Cargo.toml's `lab` feature): the simulator and its command.
#[cfg(feature = "lab")]
mod cache_policy;
