//! Compute kernels for the MoE engine. This crate knows tensors and shapes, never models.
//!
//! - [`cpu`]: matmul and grouped-expert FFN on the CPU.
pub mod cpu;
pub mod cuda;
pub mod knob;
