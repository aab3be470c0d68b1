//! Hostile and broken inputs: configs, duplicate keys, files that are not regular files,
//! tokenizer files, truncated and malformed checkpoints.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test hostile NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod bad_input;
mod hostile_config;
mod hostile_duplicates;
mod hostile_files;
mod hostile_tokenizer;

/// The tests compiled out on this system (`#[cfg(unix)]`) say so in one skip line.
#[cfg(not(unix))]
#[test]
fn unix_only_tests_say_they_are_left_out() {
    support::skip_on_this_os(
        "the special files in place of inputs (hostile_files, the FIFO half of bad_input::a_directory_or_fifo_in_place_of_a_shard_is_reported_as_what_it_is)",
        "they are FIFOs, sockets, /dev/zero and symlinks, which Windows lacks",
        "Linux or macOS",
    );
}
