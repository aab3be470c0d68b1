//! Which experts a MoE layer runs and reads: the router's choices sorted into canonical
//! order with their rows and residency (`expert_plan.rs`), the opt-in top-p and skipping
//! (`expert_selection.rs`), and the guesses read ahead for the next layer (`prefetch.rs`)
//! with the gate that judges whether a layer guesses (`prefetch_gate.rs`).

pub(crate) mod expert_plan;
pub mod expert_selection;
pub(crate) mod prefetch;
pub(crate) mod prefetch_gate;
