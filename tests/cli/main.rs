//! The `k3` binary as a user meets it: commands, stats lines, `k3 synth`, `k3 chat`'s
//! input, and the module layering of the source.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test cli NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod bench_streams;
mod chat_input;
mod cli;
mod module_layers;
mod synth;

/// The tests compiled out on this system (`#[cfg(unix)]`) say so in one skip line.
#[cfg(not(unix))]
#[test]
fn unix_only_tests_say_they_are_left_out() {
    support::skip_on_this_os(
        "the FIFO and symlink outputs (cli::outputs_go_into_fifos_stdout_and_through_symlinks, cli::a_usage_file_that_is_a_fifo_is_refused_not_replaced)",
        "Windows has no FIFOs, and its symlinks need a privilege",
        "Linux or macOS",
    );
}
