//! moe-daemon library: checkpoint loading, model definitions, the engine and (later) the server.
pub mod engine;
pub mod model;
pub mod weights;
