//! `k3 serve`: the HTTP API, its limits and errors, structured output, the reply parsers.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test serve NAME::`).

#[path = "../serve_support/mod.rs"]
mod serve_support;
#[path = "../support/mod.rs"]
mod support;

mod serve;
mod serve_api;
mod serve_parallel;
mod serve_parsers;
mod serve_structured;

/// The tests compiled out on this system (`#[cfg(unix)]`) say so in one skip line.
#[cfg(not(unix))]
#[test]
fn unix_only_tests_say_they_are_left_out() {
    support::skip_on_this_os(
        "the signals and the stalled client (serve::sigint_and_sigterm_cancel_the_running_request_and_exit_zero, serve::shutdown_closes_clients_that_read_nothing_or_send_half_a_body, serve::a_client_that_reads_nothing_pauses_the_engine_and_is_dropped)",
        "they send SIGINT and SIGTERM and size a socket buffer through libc",
        "Linux or macOS",
    );
}
