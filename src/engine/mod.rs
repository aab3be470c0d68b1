//! The engine assembled from its parts: what a machine's memory allows for the model's
//! dense weights, state, context and experts.

pub mod memory_plan;
