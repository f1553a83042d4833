use super::*;

const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;

pub(crate) fn known(name: &str) -> ModelShape {
    let (_, cfg) = known::match_known([name]).unwrap();
    ModelShape::from_config_json(&cfg).unwrap()
}

fn params_b(s: &ModelShape) -> f64 {
    // all weights at bf16, routed experts at 3·h·I
    let dense = dense_bytes(s, DenseDtype::Bf16, false);
    let dense_params = (dense.total() - dense.f32_small) as f64 / 2.0;
    let experts = (s.moe_layers() * s.experts_per_layer() * s.gpu_expert_bytes()) as f64 / 2.0;
    (dense_params + experts) / 1e9
}

/// Serving inputs as the operator builds them for a card of `card_mib`.
fn serving(card_mib: u64, max_model_len: u64, seqs: u64) -> PlanInputs {
    PlanInputs {
        budget_bytes: card_mib * MIB,
        dense: DenseChoice::Auto,
        embeddings: EmbeddingChoice::Auto,
        experts: ExpertsChoice::Auto,
        kv: KvRequest::serving(max_model_len, seqs),
        kv_dtype: KvCacheDtype::Bf16,
        max_step_tokens: 2048,
        max_step_seqs: seqs,
        stream_staging_bytes: 0,
        cuda_graphs: true,
        pins: Vec::new(),
        move_slots: 0,
        prefill_attention: crate::plan::PrefillAttention::Fused,
    }
}

#[test]
fn known_models_have_their_published_sizes() {
    // Published parameter counts: 30.5 B, 106 B (110 B with the MTP layer, not loaded), 671 B, 21.5 B.
    let cases = [
        ("Qwen/Qwen3-30B-A3B", 29.5..31.5),
        ("zai-org/GLM-4.5-Air", 104.0..108.0),
        ("deepseek-ai/DeepSeek-V3-0324", 655.0..675.0),
        ("PowerInfer/SmallThinker-21BA3B-Instruct", 21.0..22.0),
    ];
    for (name, range) in cases {
        let p = params_b(&known(name));
        assert!(range.contains(&p), "{name}: {p:.1} B parameters");
    }
    let ds = known("deepseek-ai/DeepSeek-V3");
    assert_eq!(ds.checkpoint, CheckpointFormat::Fp8 { block: 128 });
    assert_eq!(ds.moe_layers(), 58);
    assert!(matches!(
        ds.attention,
        Attention::Mla {
            kv_lora_rank: 512,
            ..
        }
    ));
    // an FP8 repo of a bf16 model gets FP8 sizes; the plain one bf16
    let q = known("Qwen/Qwen3-30B-A3B-FP8");
    assert_eq!(q.checkpoint, CheckpointFormat::Fp8 { block: 128 });
    assert_eq!(
        known("Qwen/Qwen3-30B-A3B").checkpoint,
        CheckpointFormat::Bf16
    );
    assert!(
        q.checkpoint_expert_bytes() * 2
            < known("qwen3-30b-a3b").checkpoint_expert_bytes() + 1_000_000
    );
    let glm = known("glm-4.5-air");
    assert_eq!((glm.moe_layers(), glm.layers), (45, 46));
    assert!(known::match_known(["someone/other-model"]).is_none());
}

#[test]
fn int4_and_fp8_shrink_dense_weights_as_expected() {
    let glm = known("glm-4.5-air");
    let bf16 = dense_bytes(&glm, DenseDtype::Bf16, false);
    let fp8 = dense_bytes(&glm, DenseDtype::Fp8, true);
    let int4 = dense_bytes(&glm, DenseDtype::Int4, true);
    let proj = |d: &DenseBytes| d.attention + d.dense_mlp + d.shared_experts;
    let r8 = proj(&fp8) as f64 / proj(&bf16) as f64;
    let r4 = proj(&int4) as f64 / proj(&bf16) as f64;
    assert!((0.50..0.52).contains(&r8), "{r8}");
    assert!((0.25..0.27).contains(&r4), "{r4}");
    assert_eq!(int4.embeddings, 0);
    assert_eq!(bf16.embeddings, glm.vocab * glm.hidden * 2);
    // tied tables share the bf16 copy only
    let st4 = known("smallthinker-4b");
    assert_eq!(dense_bytes(&st4, DenseDtype::Bf16, false).lm_head, 0);
    assert!(dense_bytes(&st4, DenseDtype::Int4, false).lm_head > 0);
    assert_eq!(DenseDtype::Int4.group_for(10944), Some(64));
    assert_eq!(DenseDtype::Int4.matrix_bytes(10, 48), 10 * 48 * 2);
}

#[test]
fn a_24gb_card_runs_glm_45_air_and_smallthinker_at_the_examples_context() {
    // RTX 4090: 24564 MiB. GLM-4.5-Air example: 65536 positions, 16 sequences.
    let glm = known("glm-4.5-air");
    let p = choose(&glm, &serving(24564, 65536, 16)).unwrap();
    println!("{}", p.describe());
    assert!(p.host_embeddings);
    assert_ne!(p.dense_dtype, DenseDtype::Bf16);
    assert!(p.kv_tokens >= 65536);
    assert!(p.total() <= p.usable_bytes);
    // bf16 dense weights alone do not leave room for one full-length sequence
    assert!(plan_with(&glm, &serving(24564, 65536, 16), DenseDtype::Bf16, true).is_err());

    let st = known("smallthinker-21b");
    let p = choose(&st, &serving(24564, 16384, 16)).unwrap();
    println!("{}", p.describe());
    assert!(p.kv_tokens >= 2 * 16384);
    assert!(p.gpu_experts_per_layer > 0);
}

#[test]
fn large_cards_keep_bf16_and_the_table_on_the_gpu() {
    let glm = known("glm-4.5-air");
    let p = choose(&glm, &serving(81559, 65536, 16)).unwrap();
    assert_eq!(p.dense_dtype, DenseDtype::Bf16);
    assert!(!p.host_embeddings);
    assert!(p.kv_tokens >= 2 * 65536);
    assert!(p.gpu_experts_per_layer > 0 && p.gpu_experts_per_layer < 128);
    // everything planned fits, and one more expert per layer would not
    let left = p.usable_bytes - p.total();
    assert!(left < glm.moe_layers() * glm.gpu_expert_bytes() || p.kv_tokens == 65536 * 16);
}

#[test]
fn what_does_not_fit_is_refused_with_the_reason() {
    let glm = known("glm-4.5-air");
    let mut i = serving(8 * 1024, 65536, 1);
    assert!(matches!(
        choose(&glm, &i),
        Err(PlanError::KvDoesNotFit { tokens: 65536, .. })
    ));
    i.kv = KvRequest::exactly(4096);
    i.budget_bytes = 2 * GIB;
    let e = choose(&glm, &i).unwrap_err();
    assert!(
        matches!(e, PlanError::DenseDoesNotFit { dtype: "int4", .. }),
        "{e}"
    );
    assert!(e.to_string().contains("MiB usable"));
    let mut i = serving(24564, 4096, 1);
    i.experts = ExpertsChoice::PerLayer(100);
    i.dense = DenseChoice::Fixed(DenseDtype::Int4);
    match choose(&glm, &i) {
        Err(PlanError::ExpertsDoNotFit {
            asked: 100, fit, ..
        }) => assert!(fit > 0 && fit < 100),
        other => panic!("{other:?}"),
    }
}

#[test]
fn kv_grows_into_what_is_left_up_to_its_maximum() {
    let st = known("smallthinker-21b");
    let mut i = serving(24564, 16384, 4);
    i.experts = ExpertsChoice::PerLayer(0);
    let p = choose(&st, &i).unwrap();
    assert_eq!(p.kv_tokens, 4 * 16384);
    i.kv.max_tokens = u64::MAX / 2;
    let p = choose(&st, &i).unwrap();
    assert!(p.kv_tokens > 4 * 16384);
    assert!(
        p.usable_bytes - p.total() < st.kv_bytes_per_token(plan::KV_ELEM_BYTES) * plan::KV_BLOCK
    );
}

#[test]
fn pinned_experts_count_on_top_of_the_per_layer_fill() {
    // Two layers of 8 experts: layer 0 pins 5 to the GPU, layer 1 keeps 6 in DRAM.
    let pins = [LayerPins { gpu: 5, dram: 0 }, LayerPins { gpu: 0, dram: 6 }];
    assert_eq!(gpu_experts_total(3, 8, 2, &pins), 5 + 2);
    assert_eq!(gpu_experts_total(6, 8, 2, &pins), 6 + 2);
    assert_eq!(gpu_experts_total(0, 8, 2, &pins), 5);
    assert_eq!(gpu_experts_total(3, 8, 2, &[]), 6);

    let q = known("qwen3-30b-a3b");
    let each = q.gpu_expert_bytes();
    let mut i = serving(48 * 1024, 32768, 2);
    i.dense = DenseChoice::Fixed(DenseDtype::Bf16);
    i.embeddings = EmbeddingChoice::Gpu;
    let free = choose(&q, &i).unwrap();
    // the first four layers' 128 experts pinned: auto fills fewer per layer, the bytes still fit
    i.pins = (0..q.moe_layers())
        .map(|l| LayerPins {
            gpu: if l < 4 { 128 } else { 0 },
            dram: 0,
        })
        .collect();
    let pinned = choose(&q, &i).unwrap();
    println!("{}", pinned.describe());
    assert!(pinned.gpu_experts_per_layer < free.gpu_experts_per_layer);
    let n = pinned.gpu_experts_per_layer;
    assert_eq!(pinned.gpu_experts_total, 4 * 128 + (q.moe_layers() - 4) * n);
    assert_eq!(pinned.item("GPU experts"), pinned.gpu_experts_total * each);
    assert!(pinned.total() <= pinned.usable_bytes);
    // one more per layer would not fit
    assert!(
        gpu_experts_total(n + 1, 128, q.moe_layers(), &i.pins) * each
            > pinned.usable_bytes - pinned.total() + pinned.item("GPU experts")
    );
    // asking the count that fitted without pins is refused, naming the pins
    i.experts = ExpertsChoice::PerLayer(free.gpu_experts_per_layer);
    let e = choose(&q, &i).unwrap_err();
    assert!(e.to_string().contains("pinned by placement rules"), "{e}");
    // pins alone beyond the budget
    i.pins = vec![LayerPins { gpu: 128, dram: 0 }; q.moe_layers() as usize];
    i.budget_bytes = 24 * GIB;
    let e = choose(&q, &i);
    if let Err(x) = &e {
        println!("{x}");
    }
    assert!(matches!(
        e,
        Err(PlanError::PinnedExpertsDoNotFit { pinned, .. }) if pinned == 128 * q.moe_layers()
    ));
}

#[test]
fn a_count_that_pins_already_hold_is_planned_as_without_pins() {
    // Rules pinning exactly the lowest N of every layer to the GPU and the rest to DRAM (what
    // `uniform` places): asking N plans the same bytes and experts as asking N without rules.
    let q = known("qwen3-30b-a3b");
    let mut i = serving(48 * 1024, 32768, 2);
    let free = choose(&q, &i).unwrap();
    let n = free.gpu_experts_per_layer;
    assert!(n > 0 && n < 128, "{n}");
    i.experts = ExpertsChoice::PerLayer(n);
    let asked = choose(&q, &i).unwrap();
    i.pins = vec![
        LayerPins {
            gpu: n,
            dram: 128 - n
        };
        q.moe_layers() as usize
    ];
    let pinned = choose(&q, &i).unwrap();
    assert_eq!(pinned.gpu_experts_per_layer, n);
    assert_eq!(pinned.gpu_experts_total, asked.gpu_experts_total);
    assert_eq!(pinned.total(), asked.total());
    // a count above what the pins hold still has to fit
    i.pins = vec![LayerPins { gpu: n, dram: 0 }; q.moe_layers() as usize];
    i.experts = ExpertsChoice::PerLayer(128);
    assert!(matches!(
        choose(&q, &i),
        Err(PlanError::ExpertsDoNotFit { asked: 128, .. })
    ));
}

#[test]
fn live_move_slots_are_planned() {
    let q = known("qwen3-30b-a3b");
    let mut i = serving(80 * 1024, 32768, 2);
    i.experts = ExpertsChoice::PerLayer(32);
    let off = choose(&q, &i).unwrap();
    i.move_slots = 4;
    let on = choose(&q, &i).unwrap();
    let e = q.gpu_expert_bytes();
    assert_eq!(on.item("live moves"), 4 * e + e * 5 / 4 + e);
    assert_eq!(off.item("live moves"), 0);
    assert_eq!(on.gpu_experts_per_layer, 32);
}

#[test]
fn long_prefill_scratch_follows_the_attention_path() {
    use crate::plan::{prefill_attention_bytes, PrefillAttention, PREFILL_ATTENTION_BYTES};
    // Qwen3-30B-A3B: GQA heads of 128, which the fused kernel takes: the K/V rows gathered, no scores
    let q = known("qwen3-30b-a3b");
    let (kw, vw) = q.kv_widths();
    let gathered = 2048 * (kw + vw) * 2;
    let fused = prefill_attention_bytes(&q, 2048, PrefillAttention::Fused);
    let gemm = prefill_attention_bytes(&q, 2048, PrefillAttention::Gemm);
    assert_eq!(fused, gathered);
    assert_eq!(gemm, gathered + PREFILL_ATTENTION_BYTES);
    // below 64 rows the paged kernel runs, without scratch
    assert_eq!(prefill_attention_bytes(&q, 63, PrefillAttention::Gemm), 0);
    // heads the fused kernel is not built for keep the GEMM path's score blocks
    let wide = ModelShape {
        attention: Attention::Gqa {
            heads: 16,
            kv_heads: 2,
            head_dim: 256,
            qkv_bias: false,
        },
        ..q.clone()
    };
    let wide_fused = prefill_attention_bytes(&wide, 2048, PrefillAttention::Fused);
    assert_eq!(
        wide_fused,
        prefill_attention_bytes(&wide, 2048, PrefillAttention::Gemm)
    );
    assert!(wide_fused > PREFILL_ATTENTION_BYTES);
    // MLA's prefill kernel reads the latent cache in place
    let ds = known("deepseek-ai/DeepSeek-V3");
    assert_eq!(
        prefill_attention_bytes(&ds, 2048, PrefillAttention::Gemm),
        0
    );
    // the plan's activations differ by exactly the score blocks, and the fused plan keeps the rest
    let i = serving(80 * 1024, 32768, 2);
    let with_fused = choose(&q, &i).unwrap();
    let gemm_inputs = PlanInputs {
        prefill_attention: PrefillAttention::Gemm,
        ..i.clone()
    };
    let with_gemm = choose(&q, &gemm_inputs).unwrap();
    assert_eq!(
        with_gemm.item("activations") - with_fused.item("activations"),
        PREFILL_ATTENTION_BYTES
    );
}

#[test]
fn byte_sizes_parse_with_units() {
    assert_eq!(parse_bytes("24GiB"), Ok(24 * GIB));
    assert_eq!(parse_bytes("16Gi"), Ok(16 * GIB));
    assert_eq!(parse_bytes("1.5GiB"), Ok(3 * GIB / 2));
    assert_eq!(parse_bytes("24GB"), Ok(24_000_000_000));
    assert_eq!(parse_bytes("4096"), Ok(4096));
    assert!(parse_bytes("24 parsecs").is_err());
    assert!(parse_bytes("GiB").is_err());
    assert!(parse_bytes("0").is_err());
}

/// The inputs `moe-daemon bench decode --gpu-memory-limit L --dense-dtype D --host-embeddings on
/// --gpu-experts auto` plans with (KV auto between 4096 and 65536 positions, 2048-token steps, 64
/// sequences, CUDA graphs, the layerwise-prefill stream of 256 MiB chunks).
pub(crate) fn bench_inputs(s: &ModelShape, limit_gib: u64, dense: DenseDtype) -> PlanInputs {
    PlanInputs {
        budget_bytes: limit_gib * GIB,
        dense: DenseChoice::Fixed(dense),
        embeddings: EmbeddingChoice::Host,
        experts: ExpertsChoice::Auto,
        kv: KvRequest {
            min_tokens: 4096,
            target_tokens: 65536,
            max_tokens: 65536,
            longest_sequence: 65536,
        },
        kv_dtype: KvCacheDtype::Bf16,
        max_step_tokens: 2048,
        max_step_seqs: 64,
        stream_staging_bytes: plan::stream_staging_bytes(
            s.gpu_expert_bytes(),
            s.experts_per_layer(),
            256 * MIB,
        ),
        cuda_graphs: true,
        pins: Vec::new(),
        move_slots: 0,
        prefill_attention: crate::plan::PrefillAttention::Fused,
    }
}

#[test]
fn glm_45_air_at_full_depth_fits_16_and_24_gib_with_quantized_dense_weights() {
    // The seed runs GLM-4.5-Air in ~14 GB of GPU memory with 4-bit dense weights. The device runs
    // benchmark fewer layers with the per-layer GPU experts these full-depth plans give (printed).
    let glm = known("glm-4.5-air");
    for limit in [16, 24] {
        for dense in [DenseDtype::Int4, DenseDtype::Fp8] {
            let p = choose(&glm, &bench_inputs(&glm, limit, dense)).unwrap();
            println!(
                "GLM-4.5-Air, 46 layers, {limit} GiB, {}: {} GPU experts per layer, KV {}, plan {:.2} GiB\n{}",
                dense.as_str(),
                p.gpu_experts_per_layer,
                p.kv_tokens,
                p.total() as f64 / GIB as f64,
                p.describe()
            );
            assert_eq!(p.dense_dtype, dense);
            assert!(p.total() <= p.usable_bytes);
            assert!(p.kv_tokens >= 4096, "{limit} GiB {dense:?}");
        }
    }
    // int4 needs about half the dense bytes of fp8, so it leaves room for more GPU experts
    let e = |limit, d| {
        choose(&glm, &bench_inputs(&glm, limit, d))
            .unwrap()
            .gpu_experts_per_layer
    };
    assert!(e(16, DenseDtype::Int4) > e(16, DenseDtype::Fp8));
    // An FP8 KV cache (one byte per value plus a scale per head and position) frees room for experts.
    for dense in [DenseDtype::Int4, DenseDtype::Fp8] {
        let bf16_kv = choose(&glm, &bench_inputs(&glm, 24, dense)).unwrap();
        let mut inputs = bench_inputs(&glm, 24, dense);
        inputs.kv_dtype = KvCacheDtype::Fp8;
        let fp8_kv = choose(&glm, &inputs).unwrap();
        println!(
            "GLM-4.5-Air, 24 GiB, {} dense, fp8 KV: {} GPU experts per layer (bf16 KV: {}), KV {} ({:.2} GiB)",
            dense.as_str(),
            fp8_kv.gpu_experts_per_layer,
            bf16_kv.gpu_experts_per_layer,
            fp8_kv.kv_tokens,
            fp8_kv.item("KV cache") as f64 / GIB as f64
        );
        assert_eq!(fp8_kv.kv_tokens, bf16_kv.kv_tokens);
        assert!(fp8_kv.gpu_experts_per_layer >= bf16_kv.gpu_experts_per_layer + 3);
    }
    // 128-wide heads: 128 codes and a 4-byte scale per 32 values, against 256 bytes of bf16
    let (b, f) = (
        glm.kv_cache_bytes_per_token(KvCacheDtype::Bf16),
        glm.kv_cache_bytes_per_token(KvCacheDtype::Fp8),
    );
    assert_eq!(f * 256, b * 144);
    assert_eq!(f, glm.kv_cache_bytes_per_token(KvCacheDtype::Int8));
}

/// GLM-5.3-Flash read from its config.json (multimodal layout, FP8 hub checkpoint): 34 linear layers
/// with a fixed state, 11 indexed MLA layers with the latent and the key pool's f32 indexer rows; what
/// 128K and 1M positions of one sequence cost, and a plan on one 80 GB card at 128K.
#[test]
fn glm53_flash_context_by_layer_kind() {
    let s = known("zai-org/GLM-5.3-Flash");
    assert_eq!(s.checkpoint, CheckpointFormat::Fp8 { block: 128 });
    let hy = s.hybrid.clone().unwrap();
    assert_eq!(
        (s.layers, hy.linear_layers, hy.indexer_layers),
        (45, 34, 11)
    );
    assert_eq!((s.moe_layers(), s.experts_per_layer()), (42, 288));
    let f = s.context_footprint(2);
    assert_eq!(f.kv_per_position, 11 * 512 * 2, "bf16 latent, no rope key");
    assert_eq!(
        f.indexer_per_position,
        11 * 2 * 128 * 4,
        "f32 key + pool gate"
    );
    assert_eq!(
        f.state_per_sequence,
        34 * (64 * 128 * 128 + 3 * 3 * 8192) * 4
    );
    let gib = |b: u64| b as f64 / GIB as f64;
    let (k128, m1) = (f.bytes(128 << 10, 1), f.bytes(1 << 20, 1));
    println!(
        "GLM-5.3-Flash, one sequence: 128K {:.2} GiB, 1M {:.2} GiB",
        gib(k128),
        gib(m1)
    );
    assert!((gib(k128) - 2.89).abs() < 0.01 && (gib(m1) - 22.14).abs() < 0.01);
    // Counting every layer as an MLA layer with an indexer would ask 45/11 as much per position.
    let all_attention = (45 * (512 * 2 + 256 * 4)) << 20;
    assert!(m1 * 4 < all_attention, "{m1} vs {all_attention}");
    // ~320 B parameters with the vision tower and MTP layer this shape leaves out; 288 × 42 experts.
    let p = params_b(&s);
    assert!((300.0..325.0).contains(&p), "{p}");

    let inputs = PlanInputs {
        kv: KvRequest::serving(131072, 4),
        ..serving(81559, 131072, 4)
    };
    let plan = choose(&s, &inputs).unwrap();
    println!("{}", plan.describe());
    assert!(plan.kv_tokens >= 131072 * 2, "two 128K sequences");
    assert_eq!(plan.item("recurrent states"), 4 * f.state_per_sequence);
    assert!(plan.gpu_experts_per_layer > 0 && plan.total() <= plan.usable_bytes);
    // A 1M context fits beside the dense weights, experts then take what is left.
    let m1_inputs = PlanInputs {
        kv: KvRequest::serving(1 << 20, 1),
        ..serving(81559, 1 << 20, 1)
    };
    let p1 = choose(&s, &m1_inputs).unwrap();
    assert!(p1.kv_tokens >= 1 << 20);
    assert!(p1.gpu_experts_per_layer < plan.gpu_experts_per_layer);
}

#[test]
fn glm_known_shapes_read_from_their_configs() {
    let g5 = known("zai-org/GLM-5");
    assert!(g5.hybrid.as_ref().is_some_and(|h| h.linear_layers == 0));
    assert_eq!(g5.hybrid.as_ref().unwrap().indexer_layers, 78);
    assert_eq!(g5.checkpoint, CheckpointFormat::Bf16);
    assert_eq!(
        known("zai-org/GLM-5-FP8").checkpoint,
        CheckpointFormat::Fp8 { block: 128 }
    );
    let g47 = known("zai-org/GLM-4.7-Flash");
    assert!(g47.hybrid.is_none());
    assert_eq!((g47.moe_layers(), g47.experts_per_layer()), (46, 64));
    // ~30 B (GLM-4.7-Flash) and ~744 B (GLM-5) published; MTP layers not loaded.
    let (a, b) = (params_b(&g47), params_b(&g5));
    assert!((28.0..32.0).contains(&a), "{a}");
    assert!((700.0..760.0).contains(&b), "{b}");
}
