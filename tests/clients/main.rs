//! `k3 serve` against the clients users point at it: the official Python SDKs, a browser
//! page, the coding agents. They need python3, chromium and node tools on the host and take
//! minutes.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test clients NAME::`).

#[path = "../serve_support/mod.rs"]
mod serve_support;
#[path = "../support/mod.rs"]
mod support;

mod serve_clients;
