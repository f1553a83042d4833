//! GGUF tensor data to f32: every GGML type the reader accepts, decoded with llama.cpp's reference
//! formulas (`moe_kernels::cpu::ggml`, bit-identical values). Quantized weight matrices normally skip
//! this and reach the kernels as blocks ([`super::HostData::Ggml`]); this serves vectors, routers and
//! any consumer that wants plain floats.
use super::gguf::GgmlType;

/// Decodes a whole tensor's bytes (length already checked against its type; a trailing partial block
/// is ignored).
pub fn dequantize(kind: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let (per_block, block_bytes) = kind.block();
    let blocks = bytes.len() / block_bytes;
    let mut out = vec![0f32; blocks * per_block];
    moe_kernels::cpu::ggml::dequantize(kind, &bytes[..blocks * block_bytes], &mut out);
    out
}
