//! Hugging Face safetensors checkpoints: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Files are memory-mapped; a tensor is copied out only when the
//! engine asks for it (to repack it), so after loading only the engine's own copy stays resident
//! once the maps are dropped.
//!
//! FP8 weights come with a sibling `<name>_scale_inv` (`weight_scale_inv`) tensor of 128×128 block scales;
//! [`SafetensorsDir::load`] returns them together as [`HostData::F8E4M3`].
use super::{fp8, HostData, HostTensor, TensorSource, WeightError};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// FP8 block size of DeepSeek-V3 / GLM checkpoints (`weight_block_size` in `quantization_config`).
pub const DEFAULT_FP8_BLOCK: usize = 128;

/// A tensor's shard, shape, dtype and bytes inside the map.
type RawTensor<'a> = (&'a Shard, Vec<usize>, Dtype, &'a [u8]);

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Header length + 8: where tensor data begins.
    data_start: usize,
    metadata: Metadata,
}

/// An opened checkpoint directory.
pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// tensor name → shard index
    index: HashMap<String, usize>,
    fp8_block: usize,
}

impl SafetensorsDir {
    /// Opens `dir`: the index (if any) and every shard it names, validating each header against the
    /// file size, so a truncated or corrupt file fails here, naming the file.
    pub fn open(dir: &Path) -> Result<Self, WeightError> {
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text = super::read_text_file(&index_path, super::JSON_FILE_LIMIT).map_err(|e| {
                WeightError::Io {
                    path: index_path.clone(),
                    source: e,
                }
            })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| WeightError::Invalid {
                    path: index_path.clone(),
                    message: format!("not valid JSON: {e}"),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| WeightError::Invalid {
                    path: index_path.clone(),
                    message: "no `weight_map` object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect();
            names.sort();
            names.dedup();
            if let Some(bad) = names.iter().find(|n| !is_plain_relative(n)) {
                return Err(WeightError::Invalid {
                    path: index_path.clone(),
                    message: format!(
                        "shard `{bad}` is not a file name inside the model directory \
                         (absolute paths and `..` are refused)"
                    ),
                });
            }
            names
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".to_owned()]
        } else {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| WeightError::Io {
                    path: dir.to_owned(),
                    source: e,
                })?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            names.sort();
            if names.is_empty() {
                return Err(WeightError::MissingShard {
                    path: dir.join("model.safetensors"),
                });
            }
            names
        };

        let mut shards = Vec::with_capacity(shard_names.len());
        let mut index = HashMap::new();
        for name in shard_names {
            let path = dir.join(&name);
            let shard = open_shard(&path)?;
            for tensor in shard.metadata.tensors().keys() {
                index.insert(tensor.clone(), shards.len());
            }
            shards.push(shard);
        }
        let fp8_block = read_fp8_block(dir)?.unwrap_or(DEFAULT_FP8_BLOCK);
        Ok(Self {
            dir: dir.to_owned(),
            shards,
            index,
            fp8_block,
        })
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.index.keys().cloned().collect();
        v.sort();
        v
    }

    /// Shape and dtype of a tensor without reading it.
    pub fn info(&self, name: &str) -> Option<(Vec<usize>, Dtype)> {
        let shard = &self.shards[*self.index.get(name)?];
        let info = shard.metadata.info(name)?;
        Some((info.shape.clone(), info.dtype))
    }

    fn raw(&self, name: &str) -> Result<RawTensor<'_>, WeightError> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| WeightError::MissingTensor {
                name: name.to_owned(),
                dir: self.dir.clone(),
            })?;
        let info = shard
            .metadata
            .info(name)
            .ok_or_else(|| WeightError::MissingTensor {
                name: name.to_owned(),
                dir: self.dir.clone(),
            })?;
        let (s, e) = info.data_offsets;
        let bytes = &shard.map[shard.data_start + s..shard.data_start + e];
        Ok((shard, info.shape.clone(), info.dtype, bytes))
    }
}

impl TensorSource for SafetensorsDir {
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let (shard, shape, dtype, bytes) = self.raw(name)?;
        let data = match dtype {
            Dtype::F32 => HostData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::BF16 => HostData::Bf16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            Dtype::F16 => HostData::F32(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                    .collect(),
            ),
            Dtype::F8_E4M3 => {
                let scale_name = format!("{name}_scale_inv");
                let (rows, cols) = super::matrix_dims(&shape);
                let expected = vec![
                    fp8::blocks(rows, self.fp8_block),
                    fp8::blocks(cols, self.fp8_block),
                ];
                let scales = self.load(&scale_name).map_err(|e| match e {
                    WeightError::MissingTensor { .. } => WeightError::Invalid {
                        path: shard.path.clone(),
                        message: format!("FP8 tensor `{name}` has no `{scale_name}` block scales"),
                    },
                    other => other,
                })?;
                if scales.shape != expected {
                    return Err(WeightError::Shape {
                        path: shard.path.clone(),
                        name: scale_name,
                        expected,
                        found: scales.shape,
                    });
                }
                HostData::F8E4M3 {
                    bytes: bytes.to_vec(),
                    scale_inv: scales.to_f32(),
                    block: self.fp8_block,
                }
            }
            other => {
                return Err(WeightError::UnsupportedDtype {
                    path: shard.path.clone(),
                    name: name.to_owned(),
                    dtype: other.to_string(),
                })
            }
        };
        check_finite(shard, name, &data)?;
        Ok(HostTensor { shape, data })
    }
}

/// Refuses NaN / ±inf weights (FP8 block scales are checked when they load as their own tensor).
fn check_finite(shard: &Shard, name: &str, data: &HostData) -> Result<(), WeightError> {
    let bad = match data {
        HostData::F32(v) => super::first_non_finite(v.iter().copied()),
        HostData::Bf16(v) => super::first_non_finite(v.iter().map(|x| x.to_f32())),
        // E4M3 has no infinities; S.1111.111 is its NaN.
        HostData::F8E4M3 { bytes, .. } => bytes
            .iter()
            .position(|b| b & 0x7f == 0x7f)
            .map(|i| (i, f32::NAN)),
        // GGML blocks come only from GGUF files, never from safetensors.
        HostData::Ggml { .. } => None,
    };
    match bad {
        None => Ok(()),
        Some((index, value)) => Err(WeightError::NonFinite {
            path: shard.path.clone(),
            name: name.to_owned(),
            index,
            value,
        }),
    }
}

/// A shard name from the index must stay inside the model directory: relative, no `..`, no root.
fn is_plain_relative(name: &str) -> bool {
    use std::path::Component;
    !name.is_empty()
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

/// Why a file that failed to parse as safetensors failed, with a hint when it is a GGUF file.
fn corrupt_reason(bytes: &[u8], e: impl std::fmt::Display) -> String {
    if bytes.starts_with(b"GGUF") {
        "not a valid safetensors file: this is a GGUF file; pass the .gguf file itself as --model"
            .into()
    } else {
        format!("not a valid safetensors file: {e}")
    }
}

fn open_shard(path: &Path) -> Result<Shard, WeightError> {
    let file = super::open_regular_file(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => WeightError::MissingShard {
            path: path.to_owned(),
        },
        _ => WeightError::Io {
            path: path.to_owned(),
            source: e,
        },
    })?;
    // SAFETY: the file is opened read-only; a checkpoint modified while mapped is outside our contract
    // (as for every mmap-based loader), and all reads are bounds-checked slices of the map.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| WeightError::Io {
        path: path.to_owned(),
        source: e,
    })?;
    let (header_len, metadata) =
        SafeTensors::read_metadata(&map).map_err(|e| WeightError::Corrupt {
            path: path.to_owned(),
            reason: corrupt_reason(&map, e),
        })?;
    Ok(Shard {
        path: path.to_owned(),
        map,
        data_start: header_len + 8,
        metadata,
    })
}

/// `quantization_config.weight_block_size[0]` from config.json, when present (1..=4096: the block
/// size divides every FP8 tensor's rows and columns).
fn read_fp8_block(dir: &Path) -> Result<Option<usize>, WeightError> {
    let Ok(text) = super::read_text_file(&dir.join("config.json"), super::JSON_FILE_LIMIT) else {
        return Ok(None);
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Ok(None);
    };
    let Some(b) = v
        .get("quantization_config")
        .and_then(|q| q.get("weight_block_size"))
        .and_then(|b| b.get(0))
    else {
        return Ok(None);
    };
    match b.as_u64().filter(|b| (1..=4096).contains(b)) {
        Some(b) => Ok(Some(b as usize)),
        None => Err(WeightError::Invalid {
            path: dir.join("config.json"),
            message: format!("quantization_config.weight_block_size[0] = {b}: expected 1..=4096"),
        }),
    }
}
