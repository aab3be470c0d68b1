//! Reading experts from the shards: the read modes and fault injection of shard I/O
//! (`shard_io.rs`), one expert's aligned read (`expert_reader.rs`), the loader threads
//! (`loader_pool.rs`) and the opt-in split of one read into pieces (`piece_read.rs`).

pub mod expert_reader;
pub(crate) mod loader_pool;
pub(crate) mod piece_read;
pub mod shard_io;
