//! k3: a Kimi K3 inference engine that streams routed experts from disk and runs every
//! kernel through one op interface (CPU oracle, WGSL on wgpu).
//!
//! The library is configured through typed values ([`engine::EngineConfig`] and the
//! options it carries); the command line maps flags and environment variables onto them.
//! The only environment variables the library reads itself are these, each for its reason:
//!
//! - `HOME`, `XDG_CACHE_HOME`, `LOCALAPPDATA` ([`platform::cache_dir`]): the OS's own
//!   convention for the user's cache directory, the same for every caller.
//! - `WGPU_BACKEND` ([`backend::gpu`]'s adapter enumeration, through
//!   `wgpu::Backends::from_env`): wgpu's own variable, honoured wherever wgpu runs.
//! - `K3_GPU_LIMITS` (`LimitsProfile::from_env`, when [`backend::gpu::GpuOptions`]'s
//!   `limits` is `None`): the test suites open GPUs directly and run under each profile by
//!   setting it; the command line always passes the profile explicitly.
//! - `K3_LAB_*` (`backend::gpu::device::lab_switches::LabSwitches::from_env`, compiled only with
//!   the `lab` feature and called by the command line): experiment switches, kept apart
//!   from the engine's settings.
//! - `CI` (a unit test in `backend::gpu::experts`): a missing adapter fails only on CI.

pub mod atomic_file;
pub mod backend;
pub mod canonical_json;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod experts;
pub mod generate;
pub mod grammar;
pub mod json_kind;
pub mod model;
pub mod platform;
pub mod quant;
pub mod ranks;
pub mod routed_expert;
pub mod sampling;
pub mod serve;
pub mod session;
pub mod stats;
pub mod synth;
pub mod token_picker;
pub mod tokenizer;
pub mod unique_json;
