//! GGUF-kept dense formats in the plan: bytes per format and dtype, stacking, the seeds' files.
use super::*;
use crate::stored::{gate_up_bytes, kept_note};
use crate::tests::{bench_inputs, known, GIB};
use StoredFormat::*;

// Device bytes of `[out, in]` layouts, written out (not through `GpuLayout`).
fn int4_sym(out: u64, inp: u64, g: u64) -> u64 {
    out * inp / 2 + out * (inp / g) * 2
}
fn int4_min(out: u64, inp: u64, g: u64) -> u64 {
    out * inp / 2 + out * (inp / g) * 4
}
fn w8(out: u64, inp: u64, g: u64) -> u64 {
    out * inp + out * (inp / g) * 4
}

#[test]
fn each_gguf_format_costs_what_the_gpu_keeps() {
    let (o, i) = (1000, 4096);
    let cases = [
        // (stored, int4, fp8)
        (Values, int4_sym(o, i, 128), w8(o, i, 128)),
        (Q4_0, int4_sym(o, i, 32), w8(o, i, 128)),
        (Q4_1, int4_min(o, i, 32), w8(o, i, 128)),
        (Q4K, int4_min(o, i, 32), w8(o, i, 128)),
        (Q5K, w8(o, i, 32), w8(o, i, 32)),
        (Q5_0, w8(o, i, 32), w8(o, i, 32)),
        (Q5_1, w8(o, i, 32), w8(o, i, 32)),
        (Q6K, w8(o, i, 16), w8(o, i, 16)),
        (Q8_0, w8(o, i, 32), w8(o, i, 32)),
    ];
    for (f, int4, fp8) in cases {
        assert_eq!(DenseDtype::Int4.stored_matrix_bytes(f, o, i), int4, "{f:?}");
        assert_eq!(DenseDtype::Fp8.stored_matrix_bytes(f, o, i), fp8, "{f:?}");
        assert_eq!(DenseDtype::Bf16.stored_matrix_bytes(f, o, i), o * i * 2);
    }
    // Against the dtype's own groups of 128: Q4_0 +9 %, Q4_1 / Q4_K +21 %, Q6_K 2.4× under int4.
    let own = int4_sym(o, i, 128) as f64;
    let ratio = |f| DenseDtype::Int4.stored_matrix_bytes(f, o, i) as f64 / own;
    assert!((ratio(Q4_0) - 1.0909).abs() < 1e-3, "{}", ratio(Q4_0));
    assert!((ratio(Q4K) - 1.2121).abs() < 1e-3, "{}", ratio(Q4K));
    assert!((ratio(Q6K) - 2.4242).abs() < 1e-3, "{}", ratio(Q6K));
}

#[test]
fn widths_without_whole_blocks_take_the_fallback_layouts() {
    // A row that is not whole blocks cannot come from a file of that type; the loader then
    // quantizes from the values: int8 at 32 / 16 for 8-bit types, the dtype's own layout otherwise.
    assert_eq!(
        GpuLayout::of(DenseDtype::Int4, Q8_0, 48),
        GpuLayout::W8 {
            group: 16,
            int8: true
        }
    );
    assert_eq!(
        GpuLayout::of(DenseDtype::Int4, Q4K, 1408),
        GpuLayout::Int4 {
            group: 128,
            mins: false
        }
    );
    assert_eq!(
        GpuLayout::of(DenseDtype::Fp8, Q6K, 1408),
        GpuLayout::W8 {
            group: 32,
            int8: true
        }
    );
    // widths no quantized kernel takes stay bf16
    assert_eq!(GpuLayout::of(DenseDtype::Int4, Values, 40), GpuLayout::Bf16);
    assert_eq!(GpuLayout::of(DenseDtype::Fp8, Q8_0, 8), GpuLayout::Bf16);
}

#[test]
fn gate_and_up_stack_in_one_layout_or_both_go_bf16() {
    let (inter, h) = (1408, 4096);
    let d = DenseDtype::Int4;
    assert_eq!(
        gate_up_bytes(d, Q4K, Q4K, inter, h),
        int4_min(2 * inter, h, 32)
    );
    assert_eq!(
        gate_up_bytes(d, Values, Values, inter, h),
        int4_sym(2 * inter, h, 128)
    );
    // Q4_0 codes have no minimums, Q4_K's do: one matrix cannot hold both
    assert_eq!(gate_up_bytes(d, Q4_0, Q4K, inter, h), 2 * inter * h * 2);
    assert_eq!(gate_up_bytes(d, Q4K, Q6K, inter, h), 2 * inter * h * 2);
    // under fp8 the 4-bit types are requantized alike, so they stack
    assert_eq!(
        gate_up_bytes(DenseDtype::Fp8, Q4_0, Q4K, inter, h),
        w8(2 * inter, h, 128)
    );
}

/// GLM-4.5-Air's shape as `scripts/make_gguf_glm4moe.py --dense-dtype q4_k --output-dtype q6_k`
/// writes it (the seed runs' file): Q4_K projections, Q8_0 where rows are not whole Q4_K blocks
/// (1408- and 10944-wide down projections), a Q6_K output.
fn glm_air_q4k() -> ModelShape {
    let mut s = known("glm-4.5-air");
    s.stored = Some(StoredDense {
        attention: vec![[Q4K; 4]; 46],
        dense_mlp: vec![[Q4K, Q4K, Q8_0]],
        shared_experts: vec![[Q4K, Q4K, Q8_0]; 45],
        lm_head: Q6K,
    });
    s
}

#[test]
fn glm_45_air_gguf_dense_weights_are_counted_as_kept() {
    let s = glm_air_q4k();
    let (h, q, kv) = (4096, 12288, 1024);
    let bias = (q + 2 * kv) * 4;
    let d = dense_bytes(&s, DenseDtype::Int4, true);
    let attention = int4_min(q, h, 32) + 2 * int4_min(kv, h, 32) + int4_min(h, q, 32) + bias;
    assert_eq!(d.attention, 46 * attention);
    assert_eq!(d.dense_mlp, int4_min(2 * 10944, h, 32) + w8(h, 10944, 32));
    assert_eq!(
        d.shared_experts,
        45 * (int4_min(2 * 1408, h, 32) + w8(h, 1408, 32))
    );
    assert_eq!(d.lm_head, w8(151552, h, 16));
    assert_eq!(d.embeddings, 0);
    // what the plan counted before, every projection at int4 groups of 128
    let values = dense_bytes(&known("glm-4.5-air"), DenseDtype::Int4, true);
    let more = |a: u64, b: u64| a as f64 / b as f64 - 1.0;
    println!(
        "GLM-4.5-Air Q4_K / Q6_K GGUF under int4: attention +{:.1} %, lm_head {:.2} GB (values: {:.2} GB), dense total {:.2} GiB (values: {:.2} GiB)",
        100.0 * more(d.attention, values.attention),
        d.lm_head as f64 / 1e9,
        values.lm_head as f64 / 1e9,
        d.total() as f64 / GIB as f64,
        values.total() as f64 / GIB as f64
    );
    assert!((0.20..0.22).contains(&more(d.attention, values.attention)));
    assert!((0.77e9..0.78e9).contains(&(d.lm_head as f64)));
    // Under fp8 the Q4_K tensors are requantized to E4M3 at the dtype's groups; 8-bit ones stay int8.
    let f = dense_bytes(&s, DenseDtype::Fp8, true);
    let fv = dense_bytes(&known("glm-4.5-air"), DenseDtype::Fp8, true);
    assert_eq!(f.attention, fv.attention);
    assert_eq!(f.lm_head, w8(151552, h, 16));
    // bf16 dequantizes everything: the file's formats do not matter
    assert_eq!(
        dense_bytes(&s, DenseDtype::Bf16, false),
        dense_bytes(&known("glm-4.5-air"), DenseDtype::Bf16, false)
    );
}

#[test]
fn the_plan_sizes_the_kept_codes_and_says_so() {
    let s = glm_air_q4k();
    let plain = known("glm-4.5-air");
    for limit in [16, 24] {
        let kept = choose(&s, &bench_inputs(&s, limit, DenseDtype::Int4)).unwrap();
        let values = choose(&plain, &bench_inputs(&plain, limit, DenseDtype::Int4)).unwrap();
        println!(
            "GLM-4.5-Air Q4_K GGUF, {limit} GiB, int4: {} GPU experts per layer, KV {}, plan {:.2} GiB (as values: {} experts, {:.2} GiB)\n{}",
            kept.gpu_experts_per_layer,
            kept.kv_tokens,
            kept.total() as f64 / GIB as f64,
            values.gpu_experts_per_layer,
            values.total() as f64 / GIB as f64,
            kept.describe()
        );
        assert!(kept.total() <= kept.usable_bytes);
        assert!(kept.dense.total() > values.dense.total() + GIB / 2);
        // the kept codes' extra bytes come out of GPU experts or, below the KV target, out of the KV
        // cache, or, where the slack below one more expert per layer holds them, show in the total
        let same_fill = kept.gpu_experts_per_layer == values.gpu_experts_per_layer
            && kept.kv_tokens == values.kv_tokens;
        if same_fill {
            assert_eq!(
                kept.total() - values.total(),
                kept.dense.total() - values.dense.total()
            );
        } else {
            assert!(
                kept.gpu_experts_per_layer < values.gpu_experts_per_layer
                    || kept.kv_tokens < values.kv_tokens
            );
        }
        let text = kept.describe();
        assert!(text.contains("GGUF Q6_K kept as int8/16"), "{text}");
        assert!(
            text.contains("GGUF codes kept: Q4_K as int4/32 + minimums"),
            "{text}"
        );
        assert!(text.contains("Q8_0 as int8/32"), "{text}");
    }
    // Two tensor-parallel GPUs each hold half the lm_head rows, still as int8 codes.
    let inputs = bench_inputs(&s, 24, DenseDtype::Int4);
    let p = choose_devices(&s, &inputs, 2).unwrap();
    assert_eq!(p.dense.lm_head, w8(151552 / 2, 4096, 16));
    assert_eq!(kept_note(DenseDtype::Fp8, [Q4K, Q4_0]), "");
    assert_eq!(kept_note(DenseDtype::Int4, [Q4_0, Q4_0]), "Q4_0 as int4/32");
}

#[test]
fn missing_entries_count_as_values_and_no_blocks_is_the_plain_plan() {
    let plain = known("glm-4.5-air");
    let mut s = plain.clone();
    s.stored = Some(StoredDense::default());
    assert!(!s.stored.as_ref().unwrap().any_blocks());
    for d in DenseDtype::ALL {
        for host in [false, true] {
            assert_eq!(dense_bytes(&s, d, host), dense_bytes(&plain, d, host));
        }
    }
    // A tied table kept as Q8_0 (SmolLM2's GGUF): its own int8 copy beside the bf16 table.
    let mut tied = known("smallthinker-21b");
    tied.tied_embeddings = true;
    tied.stored = Some(StoredDense {
        lm_head: Q8_0,
        ..Default::default()
    });
    let d = dense_bytes(&tied, DenseDtype::Int4, false);
    assert_eq!(d.lm_head, w8(tied.vocab, tied.hidden, 32));
    assert_eq!(d.embeddings, tied.vocab * tied.hidden * 2);
    assert_eq!(dense_bytes(&tied, DenseDtype::Bf16, false).lm_head, 0);
}
/// The H200 runs of 2026-12-02 00:30 UTC (`seed_runs.sh b`, docs/PERF.md) started with more than their
/// plans, which counted the GGUF's dense tensors as values: GLM-4.5-Air shape at 16 layers (Q4_K dense,
/// Q8_0 down projections, Q6_K output, host embeddings) int4 7.09 GiB measured against 6.39 planned (16
/// GiB budget: 8.06 against 7.35), fp8 7.85 against 7.71; SmallThinker-21B (Q4_K attention, Q6_K output)
/// int4 18.54 against 18.16, fp8 10.95 against 10.87. The dense bytes the kept formats add are those gaps,
/// to the 0.01 GiB the runs printed.
#[test]
fn the_h200_runs_start_gaps_are_the_kept_formats() {
    let mut glm = known("glm-4.5-air");
    glm.layers = 16;
    glm.moe.as_mut().unwrap().moe_layers = 15;
    let mut glm_gguf = glm.clone();
    glm_gguf.stored = Some(StoredDense {
        attention: vec![[Q4K; 4]; 16],
        dense_mlp: vec![[Q4K, Q4K, Q8_0]],
        shared_experts: vec![[Q4K, Q4K, Q8_0]; 15],
        lm_head: Q6K,
    });
    let st = known("smallthinker-21b");
    let mut st_gguf = st.clone();
    st_gguf.stored = Some(StoredDense {
        attention: vec![[Q4K; 4]; 52],
        lm_head: Q6K,
        ..Default::default()
    });
    // (values shape, GGUF shape, dtype, planned start then, measured start), GiB
    let runs = [
        (&glm, &glm_gguf, DenseDtype::Int4, 6.39, 7.09),
        (&glm, &glm_gguf, DenseDtype::Int4, 7.35, 8.06),
        (&glm, &glm_gguf, DenseDtype::Fp8, 7.71, 7.85),
        (&st, &st_gguf, DenseDtype::Int4, 18.16, 18.54),
        (&st, &st_gguf, DenseDtype::Fp8, 10.87, 10.95),
    ];
    for (values, gguf, d, planned, measured) in runs {
        let added = (dense_bytes(gguf, d, true).total() - dense_bytes(values, d, true).total())
            as f64
            / GIB as f64;
        let now = planned + added;
        println!("{d:?}: planned {planned} + {added:.3} = {now:.3} GiB, measured {measured}");
        assert!(
            (now - measured).abs() <= 0.015,
            "{d:?} {planned}: {now} vs {measured}"
        );
    }
}

#[test]
fn llama_cpp_file_types_are_read_from_names_and_reproduced() {
    assert_eq!(
        LlamaFileType::from_name(
            "unsloth/SmallThinker-21BA3B-Instruct-GGUF/SmallThinker-Q4_K_M.gguf"
        ),
        Some(LlamaFileType::Q4KM)
    );
    assert_eq!(
        LlamaFileType::from_name("m-q8_0.gguf"),
        Some(LlamaFileType::Q8_0)
    );
    assert_eq!(
        LlamaFileType::from_name("m-BF16.gguf"),
        Some(LlamaFileType::Values)
    );
    assert_eq!(LlamaFileType::from_name("model.gguf"), None);
    // SmallThinker-21B Q4_K_M: Q6_K attn_v in the 26 use_more_bits layers of 52, Q6_K output
    let st = known("smallthinker-21b");
    let s = StoredDense::llama_cpp(LlamaFileType::Q4KM, &st).unwrap();
    assert_eq!(s.attention.iter().filter(|a| a[2] == Q6K).count(), 26);
    assert!(s
        .attention
        .iter()
        .all(|a| a[0] == Q4K && a[1] == Q4K && a[3] == Q4K));
    assert_eq!(s.lm_head, Q6K);
    assert!(s.dense_mlp.is_empty() && s.shared_experts.is_empty());
    // GLM-4.5-Air: 1408- and 10944-wide down projections are not whole 256-blocks: Q4_K falls back to
    // Q5_0 (int8 codes of 32 on the GPU), Q6_K to Q8_0
    let glm = known("glm-4.5-air");
    let g = StoredDense::llama_cpp(LlamaFileType::Q4KM, &glm).unwrap();
    assert_eq!(g.dense_mlp, vec![[Q4K, Q4K, Q8_0]]); // layer 0 uses more bits
    assert_eq!(g.shared_experts.len(), 45);
    // layers 0-4 (the first eighth), 7, 10, … and 40-45 use more bits; shared experts start at layer 1
    assert_eq!(g.shared_experts[4 - 1], [Q4K, Q4K, Q8_0]);
    assert_eq!(g.shared_experts[5 - 1], [Q4K, Q4K, Q5_0]);
    assert_eq!(g.shared_experts[7 - 1], [Q4K, Q4K, Q8_0]);
    assert_eq!(
        StoredDense::llama_cpp(LlamaFileType::Q8_0, &glm)
            .unwrap()
            .lm_head,
        Q8_0
    );
    assert_eq!(
        StoredDense::llama_cpp(LlamaFileType::Q4_0, &glm)
            .unwrap()
            .lm_head,
        Q6K
    );
    assert!(StoredDense::llama_cpp(LlamaFileType::Values, &glm).is_none());
    // Mixtral's rule for 8 experts
    let mut mix = known("qwen3-30b-a3b");
    mix.moe.as_mut().unwrap().experts = 8;
    let m = StoredDense::llama_cpp(LlamaFileType::Q4KM, &mix).unwrap();
    assert!(m
        .attention
        .iter()
        .all(|a| a[1] == Q8_0 && a[2] == Q8_0 && a[3] == Q5K));
}
