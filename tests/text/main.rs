//! Text in and out: the tokenizers, chat rendering and the channel splitter,
//! grammar-constrained sampling.
//!
//! One test binary for the files beside this one, each a module (`cargo test --test text NAME::`).

#[path = "../support/mod.rs"]
mod support;

mod chat;
mod chat_splitter;
mod grammar;
mod tokenizer;
mod tokenizer_hf;
