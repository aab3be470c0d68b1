//! A K3 checkpoint on disk: shard index and extra shard directories, typed tensor views,
//! and the routed-expert table.

pub mod schema;
pub mod tensor;

pub use schema::{TensorClass, TensorSpec};
pub use tensor::{Dtype, TensorView};
