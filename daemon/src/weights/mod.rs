//! Checkpoint readers. Every format hands the engine tensors under their Hugging Face names through
//! [`TensorSource`]; the engine never sees file layouts.
//!
//! - [`safetensors`]: Hugging Face directories (single file or index + shards), memory-mapped.
//! - [`fp8`]: F8_E4M3 decoding and 128×128 block-scale dequantisation (DeepSeek-V3 / GLM FP8 layout).
pub mod fp8;
pub mod gguf;
pub mod gguf_arch;
pub mod gguf_quant;
pub mod safetensors;

use half::bf16;
use std::fs::File;
use std::path::{Path, PathBuf};

/// A tensor copied out of a checkpoint, in row-major order.
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: HostData,
}

/// Element storage. BF16 stays BF16 (half the memory of f32); F16 and FP8 are widened when read
/// through [`HostTensor::to_f32`].
#[derive(Debug, Clone)]
pub enum HostData {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    /// F8_E4M3 bytes with their block scales (`weight_scale_inv`, one f32 per `block`×`block` tile,
    /// row-major over `[ceil(rows/block), ceil(cols/block)]`).
    F8E4M3 {
        bytes: Vec<u8>,
        scale_inv: Vec<f32>,
        block: usize,
    },
    /// GGML blocks as a GGUF file stores them (Q4_0, Q4_1, Q8_0, K-quants), each row whole blocks;
    /// the CPU kernels repack them, everything else decodes them through [`HostTensor::to_f32`].
    Ggml {
        kind: gguf::GgmlType,
        bytes: Vec<u8>,
    },
}

impl HostTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Values widened to f32 (FP8 dequantised with its block scales).
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            HostData::F32(v) => v.clone(),
            HostData::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostData::F8E4M3 {
                bytes,
                scale_inv,
                block,
            } => {
                let (rows, cols) = matrix_dims(&self.shape);
                fp8::dequantize_block_scaled(bytes, scale_inv, rows, cols, *block)
            }
            HostData::Ggml { kind, bytes } => gguf_quant::dequantize(*kind, bytes),
        }
    }

    /// Values as bf16 (rounded to nearest even from f32; FP8 dequantised first).
    pub fn to_bf16(&self) -> Vec<bf16> {
        match &self.data {
            HostData::Bf16(v) => v.clone(),
            _ => self.to_f32().into_iter().map(bf16::from_f32).collect(),
        }
    }
}

/// (rows, cols) of a tensor viewed as a matrix: the last dimension is the row length.
pub fn matrix_dims(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&cols, rest)) => (rest.iter().product(), cols),
        None => (1, 1),
    }
}

/// Anything that yields tensors under Hugging Face names (safetensors directories, GGUF files).
pub trait TensorSource: Send + Sync {
    fn contains(&self, name: &str) -> bool;
    /// The tensor under its Hugging Face name; errors name the tensor and the file.
    fn load(&self, name: &str) -> Result<HostTensor, WeightError>;
    /// Whether two names read the same stored tensor (a GGUF without `output.weight` serves its token
    /// table as `lm_head.weight` too); such a pair is loaded once.
    fn same_tensor(&self, _a: &str, _b: &str) -> bool {
        false
    }
}

/// What can go wrong reading a checkpoint. Every variant names the file and, where it applies, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not what it claims to be; `reason` starts with the format ("not a valid GGUF
    /// file: …", "not a valid safetensors file: …").
    #[error("{path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: shard listed in the index is missing")]
    MissingShard { path: PathBuf },
    #[error("tensor `{name}` not found in checkpoint {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("{path}: tensor `{name}` has dtype {dtype}, which the engine does not read")]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: tensor `{name}` holds a non-finite value ({value}) at element {index}")]
    NonFinite {
        path: PathBuf,
        name: String,
        index: usize,
        value: f32,
    },
}

/// Opens a checkpoint file for reading. Anything but a regular file is refused before `open`: opening
/// a FIFO blocks until a writer appears, and a device or `/proc` file has no size to check against.
/// Symlinks are followed (the Hugging Face cache links snapshots to blobs).
pub fn open_regular_file(path: &Path) -> std::io::Result<File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO, socket or device)",
        ));
    }
    File::open(path)
}

/// Reads a small text file of a checkpoint (config.json, index, tokenizer) through
/// [`open_regular_file`], refusing files over `limit` bytes instead of reading them into memory.
pub fn read_text_file(path: &Path, limit: u64) -> std::io::Result<String> {
    use std::io::Read;
    let file = open_regular_file(path)?;
    let mut text = String::new();
    file.take(limit.saturating_add(1))
        .read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than the {limit}-byte limit for this file"),
        ));
    }
    Ok(text)
}

/// Size limit for JSON side files (config.json, generation_config.json, the shard index): the largest
/// real index (a 1,000-shard checkpoint with 100k tensors) is a few MiB.
pub const JSON_FILE_LIMIT: u64 = 64 << 20;

/// The first element that is NaN or ±inf, if any: weights that would turn every activation into NaN
/// are refused at load, naming the tensor, instead of producing garbage tokens. One compare per
/// element on data the loader is already touching.
pub fn first_non_finite(values: impl IntoIterator<Item = f32>) -> Option<(usize, f32)> {
    values.into_iter().enumerate().find(|(_, v)| !v.is_finite())
}
