//! The plan of GGUF checkpoints whose codes the GPU keeps: the sizing crate's layouts are the ones
//! `quantize_linear` / `upload_mlp` build (format by format, dtype by dtype), and on a glm4moe file with
//! llama.cpp's Q4_K_M-style types the planned dense bytes are the bytes of the host layouts the upload
//! copies to the device, exactly.
use super::*;
use crate::engine::gpu::quantize_linear;
use crate::weights::gguf::tests::write_gguf;
use crate::weights::gguf::{GgufFile, GgufValue};
use moe_kernels::cpu::{CpuTier, GroupedInput};
use moe_kernels::cuda::quant::{QuantizedMatrix, W8Code};
use moe_sizing::stored::{gate_up_bytes, use_more_bits};
use moe_sizing::{DenseDtype, GpuLayout};

const KINDS: [GgmlBlock; 11] = [
    GgmlBlock::F32,
    GgmlBlock::F16,
    GgmlBlock::Bf16,
    GgmlBlock::Q4_0,
    GgmlBlock::Q4_1,
    GgmlBlock::Q5_0,
    GgmlBlock::Q5_1,
    GgmlBlock::Q8_0,
    GgmlBlock::Q4K,
    GgmlBlock::Q5K,
    GgmlBlock::Q6K,
];

/// Random GGML blocks of `kind` for `[rows, cols]`: random codes, f16 scales set to small finite
/// values (random bytes there could be NaN or infinite).
fn random_blocks(kind: GgmlBlock, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let (_, block) = kind.block();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut data: Vec<u8> = (0..kind.row_bytes(cols).unwrap() * rows)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let f16 = |x: f32| half::f16::from_f32(x).to_le_bytes();
    // scales giving weights of order 0.05, as scripts/gguf_random.py's (a forward pass stays finite)
    for b in data.chunks_exact_mut(block) {
        match kind {
            GgmlBlock::Q6K => b[208..210].copy_from_slice(&f16(1e-5)),
            GgmlBlock::Q4K | GgmlBlock::Q5K | GgmlBlock::Q4_1 | GgmlBlock::Q5_1 => {
                b[..2].copy_from_slice(&f16(1e-4));
                b[2..4].copy_from_slice(&f16(7.5e-4));
            }
            GgmlBlock::Q4_0 => b[..2].copy_from_slice(&f16(1e-3)),
            GgmlBlock::Q5_0 => b[..2].copy_from_slice(&f16(5e-4)),
            GgmlBlock::Q8_0 => b[..2].copy_from_slice(&f16(2e-4)),
            GgmlBlock::F16 | GgmlBlock::Bf16 => b[1] &= 0x3B,
            GgmlBlock::F32 => b[3] = 0x3C,
        }
    }
    data
}

fn ggml_linear(kind: GgmlBlock, rows: usize, cols: usize, seed: u64) -> Linear {
    Linear {
        out_dim: rows,
        in_dim: cols,
        w: WeightData::Ggml {
            kind,
            bytes: random_blocks(kind, rows, cols, seed),
        },
        bias: None,
    }
}

/// The layout and host bytes of what the upload copies (`None`: bf16 rows).
fn host_layout(q: &Option<QuantizedMatrix>, rows: usize, cols: usize) -> (GpuLayout, u64) {
    match q {
        None => (GpuLayout::Bf16, (rows * cols * 2) as u64),
        Some(QuantizedMatrix::Int4 {
            group,
            packed,
            scales,
            mins,
            ..
        }) => (
            GpuLayout::Int4 {
                group: *group as u64,
                mins: mins.is_some(),
            },
            (packed.len() * 4 + scales.len() * 2 + mins.as_ref().map_or(0, |m| m.len() * 2)) as u64,
        ),
        Some(QuantizedMatrix::W8 {
            group,
            code,
            bytes,
            scales,
            ..
        }) => (
            GpuLayout::W8 {
                group: *group as u64,
                int8: *code == W8Code::Int8,
            },
            (bytes.len() + scales.len() * 4) as u64,
        ),
    }
}

#[test]
fn planned_layouts_are_what_quantize_linear_builds() {
    let mut n = 0;
    for kind in KINDS {
        // widths of whole K-quant blocks, and of whole 32-blocks only (the 4- and 8-bit 32-blocks)
        for cols in [256, 1024, 352] {
            if kind.row_bytes(cols).is_none() {
                continue;
            }
            let l = ggml_linear(kind, 12, cols, cols as u64);
            for d in DenseDtype::ALL {
                let q = quantize_linear(&l, dense_format(d));
                let (layout, bytes) = host_layout(&q, 12, cols);
                let stored = stored_format(&l);
                assert_eq!(
                    GpuLayout::of(d, stored, cols as u64),
                    layout,
                    "{kind:?} {cols} {d:?}"
                );
                assert_eq!(
                    d.stored_matrix_bytes(stored, 12, cols as u64),
                    bytes,
                    "{kind:?} {cols} {d:?}"
                );
                n += 1;
            }
        }
    }
    assert!(n >= 50, "{n} cases");
}

#[test]
fn planned_gate_up_is_what_upload_mlp_stacks() {
    let (inter, hidden) = (8, 256);
    for g in KINDS {
        for u in KINDS {
            let (gate, up) = (
                ggml_linear(g, inter, hidden, 1),
                ggml_linear(u, inter, hidden, 2),
            );
            for d in DenseDtype::ALL {
                let planned = gate_up_bytes(
                    d,
                    stored_format(&gate),
                    stored_format(&up),
                    inter as u64,
                    hidden as u64,
                );
                let bytes = stacked_gate_up_bytes(&gate, &up, d);
                assert_eq!(planned, bytes, "{g:?} + {u:?} under {d:?}");
            }
        }
    }
}

/// One tensor of a random GGUF: name (per layer: without the `blk.{i}.` prefix), block type, ggml dims
/// (innermost first).
type GgufRow = (String, GgmlBlock, Vec<u64>);

fn row(name: &str, kind: GgmlBlock, dims: &[u64]) -> GgufRow {
    (name.to_string(), kind, dims.to_vec())
}

/// A small random-weight GGUF in llama.cpp's layout, declared as a table (as `scripts/gguf_random.py`'s
/// writers do): the architecture's `{arch}.*` metadata, the tensors before, in and after the layers.
struct RandomGguf {
    arch: &'static str,
    ints: Vec<(&'static str, u64)>,
    floats: Vec<(&'static str, f64)>,
    head: Vec<GgufRow>,
    /// Layer i's tensors, named `blk.{i}.{name}` in the file.
    layers: Vec<Vec<GgufRow>>,
    tail: Vec<GgufRow>,
}

impl RandomGguf {
    /// Writes the file with random blocks of each tensor's type, or with `as_f32` the values those
    /// same blocks decode to as F32 tensors (the twin a quantized file is compared with).
    fn write(self, path: &std::path::Path, as_f32: bool) {
        let key = |k: &str| format!("{}.{k}", self.arch);
        let mut meta: Vec<(String, GgufValue)> = vec![(
            "general.architecture".into(),
            GgufValue::Str(self.arch.into()),
        )];
        meta.extend(self.ints.iter().map(|&(k, v)| (key(k), GgufValue::U64(v))));
        meta.extend(
            self.floats
                .iter()
                .map(|&(k, v)| (key(k), GgufValue::F64(v))),
        );
        let layers = self.layers.into_iter().enumerate().flat_map(|(i, rows)| {
            rows.into_iter()
                .map(move |(n, kind, dims)| (format!("blk.{i}.{n}"), kind, dims))
        });
        let tensors: Vec<(String, u32, Vec<u64>, Vec<u8>)> = self
            .head
            .into_iter()
            .chain(layers)
            .chain(self.tail)
            .enumerate()
            .map(|(i, (name, kind, dims))| {
                let cols = dims[0] as usize;
                let rows = (dims.iter().product::<u64>() / dims[0]) as usize;
                let blocks = random_blocks(kind, rows, cols, i as u64 + 7);
                if as_f32 {
                    let mut v = vec![0f32; rows * cols];
                    moe_kernels::cpu::ggml::dequantize(kind, &blocks, &mut v);
                    let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    return (name, 0, dims, bytes);
                }
                let id = match kind {
                    GgmlBlock::F32 => 0,
                    GgmlBlock::Q4_0 => 2,
                    GgmlBlock::Q5_0 => 6,
                    GgmlBlock::Q5_1 => 7,
                    GgmlBlock::Q8_0 => 8,
                    GgmlBlock::Q4K => 12,
                    GgmlBlock::Q6K => 14,
                    other => unreachable!("{other:?}"),
                };
                (name, id, dims, blocks)
            })
            .collect();
        let meta_refs: Vec<(&str, GgufValue)> =
            meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let t_refs: Vec<(&str, u32, Vec<u64>, Vec<u8>)> = tensors
            .iter()
            .map(|(n, id, d, b)| (n.as_str(), *id, d.clone(), b.clone()))
            .collect();
        std::fs::write(path, write_gguf(&meta_refs, &t_refs)).unwrap();
    }
}

/// A glm4moe file as `scripts/make_gguf_glm4moe.py --dtype q4_0 --dense-dtype q4_k --output-dtype q6_k`
/// writes it, small: hidden 256, 2 q-heads / 1 kv-head of 128 with q/k/v biases, one dense layer (ffn
/// 768) and two MoE layers of 4 experts of width 320 plus a shared one; Q8_0 where rows are not
/// whole Q4_K blocks (the 320-wide down projections).
fn small_glm_gguf(path: &std::path::Path) {
    use GgmlBlock::{Q4K, Q4_0, Q6K, Q8_0};
    let (h, ff, inter, experts, vocab, layers) = (256u64, 768u64, 320u64, 4u64, 512u64, 3u64);
    let (q, kv) = (256u64, 128u64);
    let f32 = GgmlBlock::F32;
    let k4 = |cols: u64| if cols.is_multiple_of(256) { Q4K } else { Q8_0 };
    let layer = |i: u64| {
        let mut t = vec![
            row("attn_norm.weight", f32, &[h]),
            row("attn_q.weight", k4(h), &[h, q]),
            row("attn_q.bias", f32, &[q]),
            row("attn_k.weight", k4(h), &[h, kv]),
            row("attn_k.bias", f32, &[kv]),
            row("attn_v.weight", k4(h), &[h, kv]),
            row("attn_v.bias", f32, &[kv]),
            row("attn_output.weight", k4(q), &[q, h]),
            row("post_attention_norm.weight", f32, &[h]),
        ];
        if i == 0 {
            t.extend([
                row("ffn_gate.weight", k4(h), &[h, ff]),
                row("ffn_up.weight", k4(h), &[h, ff]),
                row("ffn_down.weight", k4(ff), &[ff, h]),
            ]);
        } else {
            t.extend([
                row("ffn_gate_inp.weight", f32, &[h, experts]),
                row("exp_probs_b.bias", f32, &[experts]),
                row("ffn_gate_exps.weight", Q4_0, &[h, inter, experts]),
                row("ffn_up_exps.weight", Q4_0, &[h, inter, experts]),
                row("ffn_down_exps.weight", Q4_0, &[inter, h, experts]),
                row("ffn_gate_shexp.weight", k4(h), &[h, inter]),
                row("ffn_up_shexp.weight", k4(h), &[h, inter]),
                row("ffn_down_shexp.weight", k4(inter), &[inter, h]),
            ]);
        }
        t
    };
    RandomGguf {
        arch: "glm4moe",
        ints: vec![
            ("block_count", layers),
            ("embedding_length", h),
            ("feed_forward_length", ff),
            ("attention.head_count", 2),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 128),
            ("attention.value_length", 128),
            ("rope.dimension_count", 64),
            ("context_length", 4096),
            ("vocab_size", vocab),
            ("expert_count", experts),
            ("expert_used_count", 2),
            ("expert_shared_count", 1),
            ("expert_feed_forward_length", inter),
            ("leading_dense_block_count", 1),
        ],
        floats: vec![("expert_weights_scale", 1.0), ("rope.freq_base", 1e6)],
        head: vec![row("token_embd.weight", Q4K, &[h, vocab])],
        layers: (0..layers).map(layer).collect(),
        tail: vec![
            row("output_norm.weight", f32, &[h]),
            row("output.weight", Q6K, &[h, vocab]),
        ],
    }
    .write(path, false);
}

/// Device bytes the upload copies for `l` under `d`.
fn upload_bytes(l: &Linear, d: DenseDtype) -> u64 {
    let q = quantize_linear(l, dense_format(d));
    host_layout(&q, l.out_dim, l.in_dim).1 + l.bias.as_ref().map_or(0, |b| b.len() as u64 * 4)
}

/// Device bytes of `gate` and `up` under `d` stacked into one matrix, as `upload_mlp` stacks them.
fn stacked_gate_up_bytes(gate: &Linear, up: &Linear, d: DenseDtype) -> u64 {
    let f = dense_format(d);
    let stacked = quantize_linear(gate, f)
        .zip(quantize_linear(up, f))
        .and_then(|(a, b)| a.stack_rows(b));
    host_layout(&stacked, 2 * gate.out_dim, gate.in_dim).1
}

fn mlp_bytes(m: &Mlp, d: DenseDtype) -> u64 {
    stacked_gate_up_bytes(&m.gate, &m.up, d) + upload_bytes(&m.down, d)
}

/// Device bytes of every layer's attention projections (q, k, v, o) under `d`; the model's layers
/// are all GQA.
fn attention_bytes(model: &Model, d: DenseDtype) -> u64 {
    model
        .layers
        .iter()
        .map(|l| match &l.attn {
            HostAttention::Gqa(a) => [&a.q, &a.k, &a.v, &a.o]
                .into_iter()
                .map(|l| upload_bytes(l, d))
                .sum::<u64>(),
            _ => unreachable!("a GQA model"),
        })
        .sum()
}

/// The model a GGUF file builds to.
fn build_gguf_model(path: &std::path::Path) -> Model {
    let g = GgufFile::open(path).unwrap();
    let config = ModelConfig::from_json(&g.hf_config().unwrap()).unwrap();
    crate::model::build::build_model(config, &g).unwrap()
}

#[test]
fn a_gguf_models_dense_bytes_are_planned_exactly() {
    use StoredFormat::*;
    let path = std::env::temp_dir().join(format!("moe-plan-glm-{}.gguf", std::process::id()));
    small_glm_gguf(&path);
    let model = build_gguf_model(&path);
    std::fs::remove_file(&path).ok();
    let stored = stored_dense(&model).expect("GGUF blocks");
    assert_eq!(stored.attention, vec![[Q4K; 4]; 3]);
    assert_eq!(stored.dense_mlp, vec![[Q4K, Q4K, Q4K]]);
    assert_eq!(stored.shared_experts, vec![[Q4K, Q4K, Q8_0]; 2]);
    assert_eq!(stored.lm_head, Q6K);
    assert!(
        model.lm_head.is_some(),
        "output.weight is an lm_head of its own"
    );
    let shape = shape_of_model(&model, CheckpointFormat::Bf16);
    assert_eq!(shape.stored.as_ref(), Some(&stored));
    for d in DenseDtype::ALL {
        let planned = moe_sizing::dense_bytes(&shape, d, true);
        let (mut dense_mlp, mut shared) = (0, 0);
        for layer in &model.layers {
            match &layer.ffn {
                Ffn::Dense(m) => dense_mlp += mlp_bytes(m, d),
                Ffn::Moe(b) => shared += b.shared.as_ref().map_or(0, |m| mlp_bytes(m, d)),
            }
        }
        assert_eq!(planned.attention, attention_bytes(&model, d), "{d:?}");
        assert_eq!(planned.dense_mlp, dense_mlp, "{d:?}");
        assert_eq!(planned.shared_experts, shared, "{d:?}");
        assert_eq!(planned.lm_head, upload_bytes(model.lm_head(), d), "{d:?}");
        // the plan of the same shape as values counts less under int4 (21 % on Q4_K, 2.4× on Q6_K)
        let values =
            moe_sizing::dense_bytes(&shape_of(&model.config, true, shape.checkpoint), d, true);
        if d == DenseDtype::Int4 {
            assert!(
                planned.total() > values.total() * 6 / 5,
                "{planned:?} {values:?}"
            );
        }
    }
}

/// A quantized GGUF file and its F32 twin (the values its blocks decode to), removed however the
/// test ends.
struct TwinFiles {
    quant: std::path::PathBuf,
    twin: std::path::PathBuf,
}

impl TwinFiles {
    /// [`small_smallthinker_q4_k_m`] (with `q5`'s fallback blocks or not) and its twin, in the temp
    /// directory under `name`.
    fn smallthinker(name: &str, q5: bool) -> Self {
        let dir = std::env::temp_dir();
        let pid = std::process::id();
        let files = TwinFiles {
            quant: dir.join(format!("moe-{name}-{pid}.gguf")),
            twin: dir.join(format!("moe-{name}-f32-{pid}.gguf")),
        };
        small_smallthinker_q4_k_m(&files.quant, false, q5);
        small_smallthinker_q4_k_m(&files.twin, true, q5);
        files
    }
}

impl Drop for TwinFiles {
    fn drop(&mut self) {
        std::fs::remove_file(&self.quant).ok();
        std::fs::remove_file(&self.twin).ok();
    }
}

/// Asserts that a quantized file's logits are its twin's within `bound` rel-L2 at every step, and
/// finite.
fn assert_runs_as_twin(tag: &str, got: &[Vec<f32>], want: &[Vec<f32>], bound: f32) {
    assert_eq!(got.len(), want.len(), "{tag}: steps");
    for (step, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(a.iter().all(|x| x.is_finite()), "{tag} step {step}");
        let n: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let d: f32 = b.iter().map(|y| y * y).sum();
        let err = (n / d).sqrt();
        println!("{tag} step {step}: rel-L2 {err:.2e}");
        assert!(err <= bound, "{tag} step {step}: rel-L2 {err}");
    }
}

/// Asserts that `model`'s dense blocks are what llama.cpp's Q4_K_M rule stores (Q4_K, Q6_K attn_v in
/// the `use_more_bits` layers, a Q6_K lm_head) and what the sizing crate reads that rule as (what
/// the operator plans a Q4_K_M file with).
fn assert_llama_cpp_q4_k_m_types(model: &Model) -> StoredDense {
    use StoredFormat::{Q4K, Q6K};
    let layers = model.config.num_layers as u64;
    let stored = stored_dense(model).expect("GGUF blocks");
    let want: Vec<[StoredFormat; 4]> = (0..layers)
        .map(|i| {
            [
                Q4K,
                Q4K,
                if use_more_bits(i, layers) { Q6K } else { Q4K },
                Q4K,
            ]
        })
        .collect();
    assert_eq!(stored.attention, want);
    assert_eq!(stored.lm_head, Q6K);
    let rule = moe_sizing::StoredDense::llama_cpp(
        moe_sizing::LlamaFileType::Q4KM,
        &shape_of(&model.config, false, CheckpointFormat::Bf16),
    );
    assert_eq!(
        rule.as_ref(),
        Some(&stored),
        "llama.cpp's types as sizing reads its rule"
    );
    stored
}

/// A SmallThinker GGUF as `llama-quantize … Q4_K_M` leaves it (`scripts/make_gguf_smallthinker.py --mix
/// q4_k_m --tied`, small): Q4_K matrices, Q6_K attn_v and ffn_down_exps in the `use_more_bits` layers,
/// routers and norms F32; tied like the 4B-A0.6B, so the token table is the lm_head and Q6_K. 8 layers (one
/// in four full attention, the others over a window of 64), hidden 256, 2 q-heads / 1 kv-head of 128, 4
/// experts of 256, top-2, sigmoid router. `q5`: the `use_more_bits` layers take llama-quantize's
/// fallback types for rows that are not whole 256-blocks instead (Q5_0 ffn_down_exps and attn_output,
/// Q5_1 attn_v), as GLM-4.5-Air's 1408-wide expert down projections do in a Q4_K_M file.
fn small_smallthinker_q4_k_m(path: &std::path::Path, as_f32: bool, q5: bool) {
    use GgmlBlock::{Q4K, Q5_0, Q5_1, Q6K};
    let (h, inter, experts, vocab, layers) = (256u64, 256u64, 4u64, 512u64, 8u64);
    let f32 = GgmlBlock::F32;
    // the type of layer i's attn_v / ffn_down_exps / attn_output
    let more = |i: u64, fallback: GgmlBlock| match (use_more_bits(i, layers), q5) {
        (true, true) => fallback,
        (true, false) => Q6K,
        (false, _) => Q4K,
    };
    let layer = |i: u64| {
        vec![
            row("attn_norm.weight", f32, &[h]),
            row("attn_q.weight", Q4K, &[h, 256]),
            row("attn_k.weight", Q4K, &[h, 128]),
            row("attn_v.weight", more(i, Q5_1), &[h, 128]),
            row(
                "attn_output.weight",
                if q5 { more(i, Q5_0) } else { Q4K },
                &[256, h],
            ),
            row("ffn_norm.weight", f32, &[h]),
            row("ffn_gate_inp.weight", f32, &[h, experts]),
            row("ffn_gate_exps.weight", Q4K, &[h, inter, experts]),
            row("ffn_up_exps.weight", Q4K, &[h, inter, experts]),
            row("ffn_down_exps.weight", more(i, Q5_0), &[inter, h, experts]),
        ]
    };
    RandomGguf {
        arch: "smallthinker",
        ints: vec![
            ("block_count", layers),
            ("embedding_length", h),
            ("feed_forward_length", inter),
            ("attention.head_count", 2),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 128),
            ("attention.value_length", 128),
            ("attention.sliding_window", 64),
            ("context_length", 4096),
            ("vocab_size", vocab),
            ("expert_count", experts),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", inter),
            ("expert_gating_func", 2),
        ],
        floats: vec![("rope.freq_base", 1.5e6)],
        // no output.weight: tied
        head: vec![row("token_embd.weight", Q6K, &[h, vocab])],
        layers: (0..layers).map(layer).collect(),
        tail: vec![row("output_norm.weight", f32, &[h])],
    }
    .write(path, as_f32);
}

/// What llama.cpp users run with `-ot exps=CPU`: a Q4_K_M SmallThinker GGUF loads tied (no output tensor:
/// the Q6_K token table is the lm_head, as llama.cpp's loader falls back to it), keeps every projection's
/// block type per layer (the plan counts the Q6_K attn_v of the `use_more_bits` layers and the Q6_K
/// lm_head as int8), and computes on the CPU what the same weights as F32 compute: rel-L2 ≤ 2e-3
/// over a prefill past the window and three decode steps (the kernels keep the K-quants' codes with
/// sub-block scales rounded once to f16, ≤ 2⁻¹¹ relative; AVX2 tier and f32 KV rows on both sides).
#[test]
fn a_q4_k_m_smallthinker_gguf_loads_plans_and_runs_as_its_f32_twin() {
    let files = TwinFiles::smallthinker("st-q4km", false);
    let g = GgufFile::open(&files.quant).unwrap();
    assert_eq!(g.hf_config().unwrap()["tie_word_embeddings"], true);
    let model = build_gguf_model(&files.quant);
    assert_llama_cpp_q4_k_m_types(&model);
    // tied: the token table is loaded once and serves as lm_head, and the plan counts it once
    assert!(model.lm_head.is_none(), "a second copy of the token table");
    let shape = shape_of_model(&model, CheckpointFormat::Bf16);
    assert!(shape.tied_embeddings);
    for d in DenseDtype::ALL {
        let planned = moe_sizing::dense_bytes(&shape, d, false);
        assert_eq!(planned.attention, attention_bytes(&model, d), "{d:?}");
        // what `GpuModel::upload` uploads: an lm_head of the model's own in any dtype; a tied one
        // (none of its own) shares the bf16 table on the GPU, else gets its own copy from the table
        let lm_head = match (&model.lm_head, d) {
            (None, DenseDtype::Bf16) => 0,
            _ => upload_bytes(model.lm_head(), d),
        };
        assert_eq!(planned.lm_head, lm_head, "{d:?}");
    }
    drop(model);
    let (got, want) = (
        cpu_logits(&files.quant, true),
        cpu_logits(&files.twin, true),
    );
    assert_runs_as_twin("Q4_K_M", &got, &want, 2e-3);
}

/// The CPU engine's logits of a 70-token prefill (past the random files' window of 64) and three
/// decode steps (AVX2 tier, f32 KV rows: the same arithmetic on every machine); with `kernels` off,
/// the reference path (every weight decoded exactly).
fn cpu_logits(path: &std::path::Path, kernels: bool) -> Vec<Vec<f32>> {
    cpu_logits_on(path, kernels, Some(CpuTier::Avx2), None)
}

/// [`cpu_logits`] with the kernel tier cap (`None`: this CPU's best) and the dense projections' input
/// (`None`: each format's default).
fn cpu_logits_on(
    path: &std::path::Path,
    kernels: bool,
    tier: Option<CpuTier>,
    dense_input: Option<GroupedInput>,
) -> Vec<Vec<f32>> {
    use crate::engine::{Engine, EngineOptions, SeqInput};
    let mut opts = EngineOptions {
        cpu_kernels: kernels,
        cpu_kv_dtype: Some(crate::engine::kv::KvDtype::F32),
        ..Default::default()
    };
    opts.cpu_moe.max_tier = tier;
    opts.cpu_moe.dense_input = dense_input;
    let g = GgufFile::open(path).unwrap();
    let e = Engine::from_source(&g.hf_config().unwrap(), &g, &opts).unwrap();
    if kernels {
        // the packed experts' pages are read back from smaps: their own mappings, all resident
        let b = e.expert_page_backing().expect("experts packed").unwrap();
        assert!(b.resident() > 0 && b.resident() <= b.mapped, "{b:?}");
    }
    let vocab = e.config().vocab_size as u32;
    let mut c = e.new_cache();
    let prompt: Vec<u32> = (0..70).map(|i| (i * 37 + 5) % vocab).collect();
    [prompt, vec![7], vec![99], vec![3]]
        .into_iter()
        .map(|tokens| {
            e.reserve_and_forward(&mut [SeqInput {
                cache: &mut c,
                tokens: &tokens,
            }])
            .unwrap()
            .remove(0)
        })
        .collect()
}

/// llama-quantize's fallback blocks for rows that are not whole 256-blocks (Q5_0 for Q4_K, Q5_1 for
/// Q5_K; what a GLM-4.5-Air Q4_K_M file holds for its 1408-wide expert down projections) load, keep their
/// types, and compute on the CPU what the same weights as F32 compute: rel-L2 ≤ 2e-3 (Q5_0 codes are
/// kept exactly as int8 groups of 32 and Q5_1 codes with their minimums as int8-with-minimum groups of 32
/// on the CPU; the GPU quantizes Q5_1 to int8).
#[test]
fn q5_0_and_q5_1_blocks_run_as_their_f32_twin() {
    let files = TwinFiles::smallthinker("st-q5", true);
    let model = build_gguf_model(&files.quant);
    let stored = stored_dense(&model).expect("GGUF blocks");
    assert_eq!(
        stored.attention[0][2],
        StoredFormat::Q5_1,
        "layer 0 uses more bits"
    );
    assert_eq!(stored.attention[0][3], StoredFormat::Q5_0);
    drop(model);
    let (got, want) = (
        cpu_logits(&files.quant, true),
        cpu_logits(&files.twin, true),
    );
    assert_runs_as_twin("Q5_0 / Q5_1", &got, &want, 2e-3);
}

/// The same on files llama.cpp's own quantizer wrote (ignored in CI: needs them).
/// `MOE_LLAMA_Q4KM=q4km.gguf,twin.gguf`: a SmallThinker GGUF from `llama_model_quantize(…, Q4_K_M)`
/// (`scripts/llama_quantize.sh`) and the F32 file of the values its blocks decode to (gguf-py). The stored
/// types are llama.cpp's rule (Q6_K attn_v in the `use_more_bits` layers, Q4_K otherwise, Q6_K lm_head);
/// on the reference path (`cpu_kernels` off: every weight decoded exactly) the logits of a prefill and
/// three decode steps equal the twin's (≤ 1e-6: the files load to the same model); the CPU kernels'
/// own arithmetic (int8 activations, K-quant scales and minimums rounded to f16) is printed and only held
/// to 0.15 (measured on 16-layer random files: 2.0e-2 with every expert active, 2–7e-2 with top-2 of 16
/// where routing flips; 8e-4 for the same model as Q8_0), on the AVX2 tier and on this CPU's best tier
/// with each dense input: the default (int8 pairs with a residual in outlier groups for Q4_K, in every
/// group for Q6_K) and `Int8PairAll` (a residual in every group for Q4_K too: what
/// `MOE_CPU_DENSE_INPUT=int8pairall` forces; docs/PERF.md has the figures).
#[test]
#[ignore = "needs files from llama.cpp's quantizer: MOE_LLAMA_Q4KM=q4km.gguf,twin.gguf"]
fn llama_cpp_q4_k_m_smallthinker_runs_as_its_f32_twin() {
    let files = std::env::var("MOE_LLAMA_Q4KM").expect("MOE_LLAMA_Q4KM=q4km.gguf,twin.gguf");
    let (quant, twin) = files.split_once(',').expect("two paths");
    let (quant, twin) = (std::path::Path::new(quant), std::path::Path::new(twin));
    assert_llama_cpp_q4_k_m_types(&build_gguf_model(quant));
    let want = cpu_logits(twin, false);
    for (kernels, bound) in [(false, 1e-6), (true, 0.15)] {
        let tag = format!("CPU kernels {kernels}");
        assert_runs_as_twin(&tag, &cpu_logits(quant, kernels), &want, bound);
    }
    for input in [None, Some(GroupedInput::Int8PairAll)] {
        let tag = format!("CPU kernels, best tier, dense input {input:?}");
        assert_runs_as_twin(&tag, &cpu_logits_on(quant, true, None, input), &want, 0.15);
    }
}
