//! The CPU backend, beside `gpu/`: the step over a batch ([`forward`]), attention over the paged CPU KV
//! cache (GQA through the flash-style core in [`flash`], MLA, linear attention), hyper-connection
//! residuals, and the packing of dense projections and DRAM experts for the kernels crate's CPU kernels.
pub mod attention;
pub mod dense_pack;
pub mod experts;
mod flash;
mod forward;
pub mod hyper;
pub mod linear_attention;
