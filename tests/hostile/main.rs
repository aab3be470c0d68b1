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
