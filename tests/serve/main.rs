//! `k3 serve`: the HTTP API, its limits and errors, structured output, the reply parsers.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test serve NAME::`).

#[path = "../serve_support/mod.rs"]
mod serve_support;
#[path = "../support/mod.rs"]
mod support;

mod serve;
mod serve_api;
mod serve_parsers;
mod serve_structured;
