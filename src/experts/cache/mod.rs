//! The host expert cache: its slots per layer (`expert_cache.rs`), which expert leaves a
//! full one (`cache_policy.rs`), the usage history pins come from, the RAM budget that
//! sizes it (`ram_budget.rs`) and the guard that cuts it under memory pressure.

pub mod cache_policy;
pub(crate) mod expert_cache;
pub mod pressure_guard;
pub mod ram_budget;
pub mod usage_history;
