//! Grammar-constrained sampling through llguidance: a reply's shape (JSON, a JSON schema,
//! a forced tool call in K3's format) becomes a token mask applied to the logits before
//! each sample, over a trie of the K3 vocabulary.

pub(crate) mod closing;
pub mod constraint;
pub(crate) mod reply_grammar;
pub(crate) mod schema_check;
pub(crate) mod token_env;

pub use constraint::{CompilerBusy, GrammarCompiler, TokenConstraint};
pub use reply_grammar::{reply_lark, OutputConstraint, ReplyFrame, ToolSchema, MAX_FORCED_TOOLS};
pub use schema_check::SchemaError;
