//! The `k3` binary as a user meets it: commands, stats lines, `k3 synth`, `k3 chat`'s
//! input, and the module layering of the source.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test cli NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod chat_input;
mod cli;
mod module_layers;
mod synth;
