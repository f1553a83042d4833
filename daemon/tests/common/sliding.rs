//! The sliding-window KV scenario shared by the CPU test (CI) and the GPU test (H200): the SmallThinker
//! fixture (one full layer, three sliding ones) with its window set per test, two long sequences
//! prefilled in chunks and decoded in the same steps.
use moe_daemon::engine::{Engine, EngineOptions, SeqInput};
use std::path::Path;

/// Positions of the long sequences: far past the windows and many blocks of 16.
pub const PROMPT: usize = 300;
pub const DECODE: usize = 40;
/// Prefill chunks of the two sequences: not multiples of the block size, so chunks end inside blocks;
/// the first one long enough for the CUDA backend's GEMM attention (which reads every earlier row).
const CHUNKS: [usize; 2] = [70, 23];

/// The SmallThinker fixture with its sliding window set to `window` (5 in the fixture; a window
/// wider than a block keeps several blocks per sliding layer) and a 32K context.
pub fn model_dir(window: usize) -> tempfile::TempDir {
    let src = super::fixtures_root().join("smallthinker/model");
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg["sliding_window_size"] = window.into();
    // Room for long sequences (no RoPE scaling: the context length changes nothing else).
    cfg["max_position_embeddings"] = 32768.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// An engine on `dir` with `opts`, its KV cache 1024 positions of every layer.
pub fn engine(dir: &Path, release_window_kv: bool, opts: &EngineOptions) -> Engine {
    let opts = EngineOptions {
        release_window_kv,
        kv_cache_tokens: 1024,
        ..opts.clone()
    };
    Engine::load(dir, &opts).unwrap()
}

fn prompt(len: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut next = super::xorshift(0x2545_F491_4F6C_DD1D ^ seed);
    (0..len).map(|_| (next() % vocab as u64) as u32).collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32
}

/// Two sequences in the same steps (so blocks one gives back are soon written by the other): chunked
/// prefill, then greedy decode. Returns every step's logits, the blocks both caches hold at the end and
/// the engine's KV bytes on the CPU backend.
pub fn run(e: &Engine) -> (Vec<Vec<f32>>, usize, usize) {
    let vocab = e.config().vocab_size as u32;
    let prompts = [prompt(PROMPT, vocab, 1), prompt(PROMPT, vocab, 2)];
    let mut caches = [e.new_cache(), e.new_cache()];
    let mut done = [0usize; 2];
    let mut out = Vec::new();
    while done.iter().any(|&d| d < PROMPT) {
        let [c0, c1] = &mut caches;
        let mut batch = Vec::new();
        for (i, c) in [c0, c1].into_iter().enumerate() {
            if done[i] < PROMPT {
                let end = (done[i] + CHUNKS[i]).min(PROMPT);
                batch.push(SeqInput {
                    cache: c,
                    tokens: &prompts[i][done[i]..end],
                });
                done[i] = end;
            }
        }
        out.extend(e.reserve_and_forward(&mut batch).unwrap());
    }
    let mut last = [argmax(&out[out.len() - 1]), argmax(&out[out.len() - 1])];
    for _ in 0..DECODE {
        let [c0, c1] = &mut caches;
        let mut batch = [
            SeqInput {
                cache: c0,
                tokens: &last[..1],
            },
            SeqInput {
                cache: c1,
                tokens: &last[1..],
            },
        ];
        let logits = e.reserve_and_forward(&mut batch).unwrap();
        last = [argmax(&logits[0]), argmax(&logits[1])];
        out.extend(logits);
    }
    let held = caches.iter().map(|c| c.held_blocks()).sum();
    (out, held, e.cpu_kv_bytes().unwrap_or(0))
}
