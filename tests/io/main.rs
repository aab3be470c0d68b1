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
mod rank_shards;
mod shard_faults;
mod split_reads;
mod weight_cache;
// Lab code only (Cargo.toml's `lab` feature): the simulator and its command.
#[cfg(feature = "lab")]
mod cache_policy;

/// The skip line's group of the tests that replace or delete shards k3 holds open.
const REPLACED_WHILE_OPEN: &str = "the shards replaced or deleted while k3 holds them open (fault_reads::a_shard_replaced_while_experts_stream_is_reported, fault_reads::a_shard_deleted_while_experts_stream_is_reported_with_the_file, shard_faults::an_embedding_shard_replaced_by_rename_is_reported)";

/// The tests compiled out on this system (`#[cfg(unix)]`) say so in one skip line.
#[cfg(not(unix))]
#[test]
fn unix_only_tests_say_they_are_left_out() {
    support::skip_on_this_os(
        "the file-size limit, the writers of other processes and the special files (fault_disk; prompt_cache::the_bound_counts_entries_being_written_and_removes_abandoned_ones, prompt_cache::a_fifo_at_an_entrys_old_temporary_name_does_not_hang_the_store, weight_cache::the_same_snapshot_through_another_path_hits)",
        "they need ulimit -f and SIGXFSZ (Linux), a parent process id, FIFOs and symlinks",
        "Linux (fault_disk), Linux or macOS (the rest)",
    );
}
