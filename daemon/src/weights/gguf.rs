//! GGUF reader (llama.cpp's single-file format): memory-mapped header, metadata and tensor table;
//! F32 / F16 / BF16 / Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors (quantized ones handed on as
//! their blocks, see `moe_kernels::cpu::ggml`); and the bridge to the engine:
//! llama-architecture tensor names mapped to Hugging Face names (un-permuting Q/K rows, which llama.cpp's
//! converter interleaves for its RoPE layout) and metadata turned into an HF-style `config.json` value.
//!
//! Layout (v2/v3): magic "GGUF", version u32, tensor count u64, metadata count u64, metadata key/values,
//! tensor infos (name, dims innermost-first, type, offset), padding to `general.alignment` (32), data.
use super::gguf_arch::GgufRef;
use super::{HostData, HostTensor, TensorSource, WeightError};
use half::bf16;
use memmap2::Mmap;
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

type Metadata = HashMap<String, GgufValue>;
type TensorTable = HashMap<String, GgufTensorInfo>;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U64(v) => Some(v),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F64(v) => Some(v),
            GgufValue::U64(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Tensor element encodings this reader reads (ggml type ids); decoding lives with the kernels.
pub use moe_kernels::cpu::GgmlBlock as GgmlType;

/// Where one tensor lives in the file.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    /// Dimensions innermost first, as stored (ggml `ne`).
    pub dims: Vec<usize>,
    pub kind: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

/// An opened GGUF file: metadata parsed, tensor data left in the mapping until asked for.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub metadata: HashMap<String, GgufValue>,
    pub tensors: HashMap<String, GgufTensorInfo>,
}

/// A little-endian cursor over the mapping; every read is bounds-checked.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| format!("truncated at byte {} (wanted {n} more)", self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().unwrap_or([0; 4]),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().unwrap_or([0; 8]),
        ))
    }
    fn len(&mut self) -> Result<usize, String> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len())
            .ok_or_else(|| format!("length {n} at byte {} exceeds the file", self.pos))
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.len()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| format!("invalid UTF-8 string at byte {}", self.pos))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue, String> {
        Ok(match ty {
            0 => GgufValue::U64(self.u8()? as u64),
            1 => GgufValue::I64(self.u8()? as i8 as i64),
            2 => GgufValue::U64(u16::from_le_bytes([self.u8()?, self.u8()?]) as u64),
            3 => GgufValue::I64(i16::from_le_bytes([self.u8()?, self.u8()?]) as i64),
            4 => GgufValue::U64(self.u32()? as u64),
            5 => GgufValue::I64(self.u32()? as i32 as i64),
            6 => GgufValue::F64(f32::from_bits(self.u32()?) as f64),
            7 => GgufValue::Bool(self.u8()? != 0),
            8 => GgufValue::Str(self.string()?),
            9 if depth < 4 => {
                let elem = self.u32()?;
                let n = self.len()?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(elem, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(self.u64()? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64()?)),
            _ => return Err(format!("unknown metadata value type {ty}")),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, WeightError> {
        let io = |source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = super::open_regular_file(path).map_err(io)?;
        // SAFETY: the mapping is read-only and the file is not modified while the daemon runs.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (metadata, tensors) = parse(&map).map_err(|reason| WeightError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("not a valid GGUF file: {reason}"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            metadata,
            tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    fn invalid(&self, message: String) -> WeightError {
        WeightError::Invalid {
            path: self.path.clone(),
            message,
        }
    }

    /// NaN or infinite weights are refused, naming the tensor (they would poison every output).
    fn check_finite(
        &self,
        name: &str,
        data: impl IntoIterator<Item = f32>,
    ) -> Result<(), WeightError> {
        match super::first_non_finite(data) {
            Some((index, value)) => Err(WeightError::NonFinite {
                path: self.path.clone(),
                name: name.to_string(),
                index,
                value,
            }),
            None => Ok(()),
        }
    }

    /// A tensor under its GGUF name, dequantised to f32, with its shape in row-major (HF) order.
    pub fn load_gguf(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), WeightError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightError::MissingTensor {
                name: name.to_string(),
                dir: self.path.clone(),
            })?;
        // `start + len <= map.len()` was checked when the table was parsed.
        let bytes = &self.map[info.start..info.start + info.len];
        let data = super::gguf_quant::dequantize(info.kind, bytes);
        self.check_finite(name, data.iter().copied())?;
        let shape = info.dims.iter().rev().copied().collect();
        Ok((shape, data))
    }

    fn arch(&self) -> &str {
        self.get("general.architecture")
            .and_then(GgufValue::as_str)
            .unwrap_or("")
    }

    fn arch_u64(&self, key: &str) -> Result<u64, WeightError> {
        let full = format!("{}.{key}", self.arch());
        self.get(&full)
            .and_then(GgufValue::as_u64)
            .ok_or_else(|| self.invalid(format!("metadata `{full}` missing or not an integer")))
    }

    /// HF-style config.json for the llama-family architectures this reader maps.
    pub fn hf_config(&self) -> Result<serde_json::Value, WeightError> {
        let arch = self.arch();
        if super::gguf_arch::is_moe_arch(arch) {
            return super::gguf_arch::hf_config(self, arch);
        }
        if arch != "llama" {
            return Err(self.invalid(format!(
                "GGUF architecture `{arch}` is not supported (supported: llama, qwen3moe, glm4moe, deepseek2, smallthinker)"
            )));
        }
        let heads = self.arch_u64("attention.head_count")?;
        let kv_heads = self.arch_u64("attention.head_count_kv").unwrap_or(heads);
        let hidden = self.arch_u64("embedding_length")?;
        let vocab = match self.arch_u64("vocab_size") {
            Ok(v) => v,
            Err(_) => self
                .get("tokenizer.ggml.tokens")
                .and_then(GgufValue::as_array)
                .map(|a| a.len() as u64)
                .ok_or_else(|| self.invalid("no vocab_size and no tokenizer.ggml.tokens".into()))?,
        };
        let f = |k: &str, default: f64| {
            self.get(&format!("{arch}.{k}"))
                .and_then(GgufValue::as_f64)
                .unwrap_or(default)
        };
        let tok_id = |k: &str| self.get(k).and_then(GgufValue::as_u64);
        Ok(json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": self.arch_u64("feed_forward_length")?,
            "num_hidden_layers": self.arch_u64("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": hidden / heads.max(1),
            "rms_norm_eps": f("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": f("rope.freq_base", 10000.0),
            "max_position_embeddings": self.arch_u64("context_length").unwrap_or(2048),
            "vocab_size": vocab,
            "tie_word_embeddings": !self.tensors.contains_key("output.weight"),
            "bos_token_id": tok_id("tokenizer.ggml.bos_token_id"),
            "eos_token_id": tok_id("tokenizer.ggml.eos_token_id"),
            "hidden_act": "silu",
            "attention_bias": false,
            "torch_dtype": "float32",
        }))
    }

    /// The GGUF tensor (name, un-permutation head count, expert slice) behind a Hugging Face name.
    fn gguf_name(&self, hf: &str) -> Option<GgufRef> {
        let fixed = match hf {
            "model.embed_tokens.weight" => Some("token_embd.weight"),
            "model.norm.weight" => Some("output_norm.weight"),
            "lm_head.weight" if self.tensors.contains_key("output.weight") => Some("output.weight"),
            "lm_head.weight" => Some("token_embd.weight"),
            _ => None,
        };
        if let Some(n) = fixed {
            return Some(GgufRef {
                name: n.to_string(),
                permute: None,
                expert: None,
            });
        }
        if super::gguf_arch::is_moe_arch(self.arch()) {
            return super::gguf_arch::tensor_ref(self.arch(), hf);
        }
        let rest = hf.strip_prefix("model.layers.")?;
        let (layer, suffix) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let heads = self.arch_u64("attention.head_count").ok()? as usize;
        let kv_heads = self
            .arch_u64("attention.head_count_kv")
            .map(|v| v as usize)
            .unwrap_or(heads);
        let (g, permute) = match suffix {
            "input_layernorm.weight" => ("attn_norm.weight", None),
            "post_attention_layernorm.weight" => ("ffn_norm.weight", None),
            "self_attn.q_proj.weight" => ("attn_q.weight", Some(heads)),
            "self_attn.k_proj.weight" => ("attn_k.weight", Some(kv_heads)),
            "self_attn.v_proj.weight" => ("attn_v.weight", None),
            "self_attn.o_proj.weight" => ("attn_output.weight", None),
            "mlp.gate_proj.weight" => ("ffn_gate.weight", None),
            "mlp.up_proj.weight" => ("ffn_up.weight", None),
            "mlp.down_proj.weight" => ("ffn_down.weight", None),
            _ => return None,
        };
        Some(GgufRef {
            name: format!("blk.{layer}.{g}"),
            permute,
            expert: None,
        })
    }
}

impl TensorSource for GgufFile {
    fn same_tensor(&self, a: &str, b: &str) -> bool {
        match (self.gguf_name(a), self.gguf_name(b)) {
            (Some(a), Some(b)) => a.name == b.name && a.expert == b.expert,
            _ => false,
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.gguf_name(name).is_some_and(|r| {
            self.tensors.get(&r.name).is_some_and(|t| match r.expert {
                Some(e) => t.dims.len() == 3 && e < t.dims[2],
                None => true,
            })
        })
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let GgufRef {
            name: g,
            permute,
            expert,
        } = self
            .gguf_name(name)
            .ok_or_else(|| WeightError::MissingTensor {
                name: name.to_string(),
                dir: self.path.clone(),
            })?;
        let info = self
            .tensors
            .get(&g)
            .ok_or_else(|| WeightError::MissingTensor {
                name: format!("{name} (GGUF `{g}`)"),
                dir: self.path.clone(),
            })?;
        let mut shape: Vec<usize> = info.dims.iter().rev().copied().collect();
        let mut bytes = &self.map[info.start..info.start + info.len];
        if let Some(e) = expert {
            // One expert of a merged `[E, rows, cols]` tensor: its bytes are the e-th of E equal parts.
            if shape.len() != 3 || e >= shape[0] {
                return Err(
                    self.invalid(format!("tensor `{g}`: shape {shape:?} has no expert {e}"))
                );
            }
            let per = bytes.len() / shape[0];
            bytes = &bytes[e * per..(e + 1) * per];
            shape.remove(0);
        }
        let rows = shape.first().copied().unwrap_or(0);
        let cols = shape.last().copied().unwrap_or(1);
        if let Some(heads) = permute {
            if shape.len() != 2
                || heads == 0
                || heads.checked_mul(2).is_none_or(|h2| rows % h2 != 0)
            {
                return Err(self.invalid(format!(
                    "tensor `{g}`: {rows} rows do not split into {heads} rotary heads"
                )));
            }
        }
        let data = match info.kind {
            GgmlType::Bf16 => {
                // Kept in bf16 (half the memory of widening to f32: a 40 GiB bf16 file would
                // otherwise take 80 GB in checkpoint form before its experts are packed).
                let mut data: Vec<bf16> = bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect();
                self.check_finite(name, data.iter().map(|x| x.to_f32()))?;
                if let Some(heads) = permute {
                    data = unpermute_rotary_rows(&data, rows, cols, heads);
                }
                HostData::Bf16(data)
            }
            GgmlType::F32 | GgmlType::F16 => {
                let mut data = super::gguf_quant::dequantize(info.kind, bytes);
                self.check_finite(name, data.iter().copied())?;
                if let Some(heads) = permute {
                    data = unpermute_rotary_rows(&data, rows, cols, heads);
                }
                HostData::F32(data)
            }
            kind => {
                // Quantized: rows stay as their blocks (the kernels repack them at load).
                let rb = kind.row_bytes(cols).ok_or_else(|| {
                    self.invalid(format!(
                        "tensor `{g}`: rows of {cols} are not whole {} blocks",
                        kind.name()
                    ))
                })?;
                let mut data = bytes.to_vec();
                if let Some(heads) = permute {
                    data = unpermute_rotary_rows(&data, rows, rb, heads);
                }
                HostData::Ggml { kind, bytes: data }
            }
        };
        Ok(HostTensor { shape, data })
    }
}

/// Undoes llama.cpp's Q/K row interleave: GGUF row `h*d + 2i + j` holds HF row `h*d + j*d/2 + i`.
pub fn unpermute_rotary_rows<T: Copy + Default>(
    data: &[T],
    rows: usize,
    cols: usize,
    heads: usize,
) -> Vec<T> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![T::default(); data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + 2 * i + j;
                let dst = h * head_dim + j * half + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn parse(buf: &[u8]) -> Result<(Metadata, TensorTable), String> {
    let mut c = Cursor { buf, pos: 0 };
    if c.take(4)? != b"GGUF" {
        // A safetensors file starts with its header length (u64) and then the JSON header's `{`.
        if buf.get(8) == Some(&b'{') {
            return Err(
                "bad magic: this is a safetensors file; pass its directory as --model".into(),
            );
        }
        return Err("bad magic (expected `GGUF`)".into());
    }
    let version = c.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!("unsupported GGUF version {version}"));
    }
    let n_tensors = c.len()?;
    let n_kv = c.len()?;
    let mut metadata = HashMap::new();
    for _ in 0..n_kv {
        let key = c.string()?;
        let ty = c.u32()?;
        let v = c
            .value(ty, 0)
            .map_err(|e| format!("metadata `{key}`: {e}"))?;
        if metadata.contains_key(&key) {
            return Err(format!("metadata `{key}` appears twice"));
        }
        metadata.insert(key, v);
    }
    let mut raw = Vec::with_capacity(n_tensors.min(1 << 20));
    for _ in 0..n_tensors {
        let name = c.string()?;
        let n_dims = c.u32()? as usize;
        if n_dims > 4 {
            return Err(format!("tensor `{name}` has {n_dims} dimensions"));
        }
        let dims = (0..n_dims)
            .map(|_| c.len())
            .collect::<Result<Vec<_>, _>>()?;
        let ty = c.u32()?;
        let offset = c.len()?;
        raw.push((name, dims, ty, offset));
    }
    let align = alignment(&metadata)?;
    let data_start = c
        .pos
        .div_ceil(align)
        .checked_mul(align)
        .ok_or("data section start overflows")?;
    let mut tensors = HashMap::new();
    for (name, dims, ty, offset) in raw {
        let kind = GgmlType::from_ggml_id(ty)
            .ok_or_else(|| format!("tensor `{name}` has ggml type {ty}, which is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)"))?;
        let numel = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("tensor `{name}`: element count overflows"))?;
        let (per_block, block_bytes) = kind.block();
        if numel % per_block != 0 {
            return Err(format!(
                "tensor `{name}`: {numel} elements not a multiple of block {per_block}"
            ));
        }
        let len = (numel / per_block)
            .checked_mul(block_bytes)
            .ok_or_else(|| format!("tensor `{name}`: byte length overflows"))?;
        if offset % align != 0 {
            return Err(format!(
                "tensor `{name}`: offset {offset} is not a multiple of the alignment {align}"
            ));
        }
        let start = data_start
            .checked_add(offset)
            .filter(|s| s.checked_add(len).is_some_and(|e| e <= buf.len()))
            .ok_or_else(|| {
                format!("tensor `{name}` extends past the end of the file (truncated?)")
            })?;
        if tensors.contains_key(&name) {
            return Err(format!("tensor `{name}` appears twice"));
        }
        tensors.insert(
            name,
            GgufTensorInfo {
                dims,
                kind,
                start,
                len,
            },
        );
    }
    Ok((metadata, tensors))
}

/// `general.alignment`: 32 when absent; otherwise a power of two (llama.cpp refuses anything else;
/// 0 would make every tensor offset meaningless).
fn alignment(metadata: &Metadata) -> Result<usize, String> {
    let Some(v) = metadata.get("general.alignment") else {
        return Ok(32);
    };
    v.as_u64()
        .and_then(|a| usize::try_from(a).ok())
        .filter(|a| a.is_power_of_two() && *a <= 1 << 20)
        .ok_or_else(|| format!("general.alignment {v:?} must be a power of two up to 1 MiB"))
}

pub use super::gguf_quant::dequantize;

#[cfg(test)]
#[path = "gguf_tests.rs"]
pub(crate) mod tests;
