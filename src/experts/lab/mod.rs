//! Research code, built only with the `lab` feature: the cache-policy simulator over
//! recorded routes (`cache_policy_sim.rs`) and the synthetic routes it is checked on
//! (`cache_policy_synth.rs`).

pub mod cache_policy_sim;
pub mod cache_policy_synth;
