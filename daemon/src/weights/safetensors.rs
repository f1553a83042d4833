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
use std::fs::File;
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
            let text = std::fs::read_to_string(&index_path).map_err(|e| WeightError::Io {
                path: index_path.clone(),
                source: e,
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
        let fp8_block = read_fp8_block(dir).unwrap_or(DEFAULT_FP8_BLOCK);
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
        Ok(HostTensor { shape, data })
    }
}

fn open_shard(path: &Path) -> Result<Shard, WeightError> {
    let file = File::open(path).map_err(|e| match e.kind() {
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
            reason: e.to_string(),
        })?;
    Ok(Shard {
        path: path.to_owned(),
        map,
        data_start: header_len + 8,
        metadata,
    })
}

/// `quantization_config.weight_block_size[0]` from config.json, when present.
fn read_fp8_block(dir: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let b = v
        .get("quantization_config")?
        .get("weight_block_size")?
        .get(0)?
        .as_u64()?;
    Some(b as usize)
}
