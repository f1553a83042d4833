//! moe-daemon library: checkpoint loading, model definitions, the engine and the OpenAI server.
pub mod api;
pub mod cli;
pub mod engine;
pub mod metrics;
pub mod model;
pub mod sched;
pub mod text;
pub mod weights;
