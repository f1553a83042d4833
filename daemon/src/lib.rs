//! moe-daemon library: checkpoint loading, model definitions, the engine and (later) the server.
pub mod model;
pub mod weights;
pub mod engine;
