//! What `--model` names for the offline commands (`generate`, `bench`): a Hugging Face directory
//! (config.json + safetensors) or a GGUF file; loads the engine and the tokenizer from either.
use crate::engine::{Engine, EngineOptions};
use crate::text::TextTokenizer;
use crate::weights::gguf::GgufFile;
use anyhow::Context;
use std::path::{Path, PathBuf};

pub enum ModelPath {
    Dir(PathBuf),
    Gguf { path: PathBuf, file: GgufFile },
}

impl ModelPath {
    /// A directory, or a file read as GGUF (its header is parsed here, the weights later).
    pub fn open(path: &Path) -> anyhow::Result<ModelPath> {
        if path.is_dir() {
            return Ok(ModelPath::Dir(path.to_path_buf()));
        }
        if !path.exists() {
            anyhow::bail!(
                "--model {}: no such file or directory (give a checkpoint directory or a .gguf file)",
                path.display()
            );
        }
        let file = GgufFile::open(path)
            .with_context(|| format!("--model {}: not a readable GGUF file", path.display()))?;
        Ok(ModelPath::Gguf {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        match self {
            ModelPath::Dir(p) | ModelPath::Gguf { path: p, .. } => p,
        }
    }

    /// The model's configuration, without loading weights.
    pub fn config(&self) -> anyhow::Result<crate::model::ModelConfig> {
        match self {
            ModelPath::Dir(dir) => Ok(crate::model::ModelConfig::from_dir(dir)?),
            ModelPath::Gguf { file, .. } => {
                crate::model::ModelConfig::from_json(&file.hf_config()?).map_err(Into::into)
            }
        }
    }

    pub fn load_engine(&self, opts: &EngineOptions) -> anyhow::Result<Engine> {
        match self {
            ModelPath::Dir(dir) => Engine::load(dir, opts),
            ModelPath::Gguf { path, file } => {
                let cfg = file.hf_config()?;
                Engine::from_source(&cfg, file, opts)
                    .with_context(|| format!("loading {}", path.display()))
            }
        }
    }

    /// The tokenizer: `tokenizer.json` of a directory (`None` without one), or the GGUF's vocabulary.
    pub fn tokenizer(&self) -> anyhow::Result<Option<PromptTokenizer>> {
        Ok(match self {
            ModelPath::Dir(dir) => {
                let path = dir.join("tokenizer.json");
                if !path.exists() {
                    return Ok(None);
                }
                let t = tokenizers::Tokenizer::from_file(&path)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                Some(PromptTokenizer::Hf(Box::new(t)))
            }
            ModelPath::Gguf { file, .. } => Some(PromptTokenizer::Gguf(Box::new(
                TextTokenizer::from_gguf(file)?,
            ))),
        })
    }
}

/// A prompt tokenizer: `tokenizer.json` (special tokens such as BOS added as its post-processor
/// says) or a GGUF vocabulary (text taken as is: special-token strings become their ids).
pub enum PromptTokenizer {
    Hf(Box<tokenizers::Tokenizer>),
    Gguf(Box<TextTokenizer>),
}

impl PromptTokenizer {
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match self {
            PromptTokenizer::Hf(t) => Ok(t
                .encode(text, true)
                .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
                .get_ids()
                .to_vec()),
            PromptTokenizer::Gguf(t) => Ok(t.encode(text)?),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        match self {
            PromptTokenizer::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| anyhow::anyhow!("decoding: {e}")),
            PromptTokenizer::Gguf(t) => Ok(t.decode(ids, true)?),
        }
    }
}
