//! What the expert source hands a MoE layer's consumer: each expert's bytes in host memory,
//! or only its id where the backend holds it, and where an expert of a layer's list stands
//! while the layer streams.

use crate::config::Config;
use crate::routed_expert::{ExpertPayload, LoadedExpert};
use anyhow::{anyhow, Result};
use std::sync::Arc;

/// Where one expert of a layer's list stands while the layer streams: in host memory (the
/// cache's, or read just now), still to be read, or resident in the backend.
pub(crate) enum Item {
    Ready(Arc<LoadedExpert>),
    Miss(u32),
    Resident(u32),
}

impl Item {
    /// The expert as the consumer gets it; a miss is handed over only once read.
    pub(crate) fn supplied(&self) -> Result<Supplied<'_>> {
        match self {
            Item::Ready(e) => Ok(Supplied::Host(e)),
            Item::Resident(id) => Ok(Supplied::Resident(*id)),
            Item::Miss(id) => Err(anyhow!("internal: expert {id} handed over before its read")),
        }
    }
}

/// One expert handed to the consumer: its bytes in host memory, or only its id when the
/// backend already holds it resident (the GPU tier).
#[derive(Clone, Copy)]
pub enum Supplied<'a> {
    /// Host bytes, from the cache or just read.
    Host(&'a LoadedExpert),
    /// Held by the backend; nothing was read.
    Resident(u32),
}

impl Supplied<'_> {
    /// The expert's id within its layer.
    pub fn id(&self) -> u32 {
        match self {
            Supplied::Host(e) => e.id,
            Supplied::Resident(id) => *id,
        }
    }

    /// Where the expert's bytes are, as the backend runs it.
    pub fn payload(&self, cfg: &Config) -> Result<ExpertPayload<'_>> {
        match self {
            Supplied::Host(e) => e.payload(cfg),
            Supplied::Resident(_) => Ok(ExpertPayload::Resident),
        }
    }
}
