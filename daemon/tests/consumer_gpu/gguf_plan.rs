//! The memory plan of a GGUF whose codes the GPU keeps (Q4_K dense weights as int4 groups of 32 with
//! minimums, the Q6_K output as int8 groups of 16, Q8_0 down projections as int8): what the start
//! allocates is what the plan says, to 0.5 % + 4 MiB (bf16 checkpoints match to the MiB), where the plan
//! of the same model as values (every projection at the dtype's groups of 128) is off by more.
//!
//! The file is the benchmarks' own generator's (`scripts/make_gguf_glm4moe.py`, llama.cpp's glm4moe
//! layout, Q4_K_M-style types), small: `MOE_PLAN_GGUF` names one, else it is written to the temp
//! directory (needs python3 with numpy and the PyPI `gguf` package, e.g. the peer kit's wheel on
//! PYTHONPATH).
use moe_daemon::cli::model_path::ModelPath;
use moe_daemon::engine::gpu::memory::{self, MemoryReport};
use moe_daemon::engine::placement::GpuExperts;
use moe_daemon::engine::{Device, EngineOptions};
use moe_sizing::{DenseChoice, DenseDtype, EmbeddingChoice};
use std::path::PathBuf;

/// GLM-4.5-Air's layer types at a smaller width: 3 layers (1 dense), hidden 1024, 8 q-heads / 2 kv-heads
/// of 128, 8 experts of 704 + a shared one, vocab 32768; Q4_0 experts, Q4_K dense, Q6_K output, Q8_0
/// for the 704-wide down projections (not whole Q4_K blocks). 75 MB.
const GEN_ARGS: &str =
    "--layers 3 --dense-layers 1 --experts 8 --topk 2 --hidden 1024 --inter 704 \
    --ffn 2816 --heads 8 --kv-heads 2 --head-dim 128 --vocab 32768 --dtype q4_0 --dense-dtype q4_k \
    --output-dtype q6_k";

fn plan_gguf() -> PathBuf {
    if let Some(p) = std::env::var_os("MOE_PLAN_GGUF") {
        return PathBuf::from(p);
    }
    let out = std::env::temp_dir().join("moe-plan-glm4moe-q4k.gguf");
    if out.exists() {
        return out;
    }
    // run from the repository root (the device), else from the source tree
    let script = ["scripts", "../scripts"]
        .iter()
        .map(|d| PathBuf::from(d).join("make_gguf_glm4moe.py"))
        .chain([PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/make_gguf_glm4moe.py")])
        .find(|p| p.exists())
        .expect("scripts/make_gguf_glm4moe.py (or MOE_PLAN_GGUF)");
    let status = std::process::Command::new("python3")
        .arg(&script)
        .args(GEN_ARGS.split_whitespace())
        .arg("--out")
        .arg(&out)
        .status()
        .expect("python3");
    assert!(
        status.success(),
        "{} failed: needs numpy and the gguf package (or set MOE_PLAN_GGUF)",
        script.display()
    );
    out
}

#[test]
fn plan_matches_allocation_on_a_gguf_with_kept_codes() {
    let path = plan_gguf();
    let model = ModelPath::open(&path).unwrap();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut failures = Vec::new();
    for (dense, host_embeddings) in [
        (DenseDtype::Int4, false),
        (DenseDtype::Int4, true),
        (DenseDtype::Fp8, true),
    ] {
        let opts = EngineOptions {
            device: Device::Cuda(0),
            gpu_experts: GpuExperts::Count(2),
            kv_cache_tokens: 8192,
            gpu_memory_limit: Some(24 << 30),
            dense_dtype: DenseChoice::Fixed(dense),
            embeddings: if host_embeddings {
                EmbeddingChoice::Host
            } else {
                EmbeddingChoice::Gpu
            },
            max_step_tokens: 2048,
            max_step_seqs: 16,
            cuda_graphs: true,
            ..Default::default()
        };
        let e = model.load_engine(&opts).unwrap();
        let report = e.gpu_memory().unwrap().clone();
        let planned = report.planned_at_start();
        // the same model planned as values: what the plan said before it knew the file's formats
        let as_values = memory::shape_of(e.config(), true, moe_sizing::CheckpointFormat::Bf16);
        let plan_values = memory::plan(&opts, &as_values, 24 << 30, &[]).unwrap();
        let planned_values = MemoryReport {
            plan: plan_values,
            ..report.clone()
        }
        .planned_at_start();
        let tolerance = planned / 200 + (4 << 20);
        let case = format!(
            "{} dense, host embeddings {host_embeddings}",
            dense.as_str()
        );
        println!(
            "{case}: start {:.1} MiB, planned {:.1} MiB (as values: {:.1} MiB)\n{}",
            mib(report.start_allocated),
            mib(planned),
            mib(planned_values),
            report.plan.describe()
        );
        if report.start_allocated.abs_diff(planned) > tolerance {
            failures.push(format!(
                "{case}: start {:.1} MiB, planned {:.1} MiB",
                mib(report.start_allocated),
                mib(planned)
            ));
        }
        // the test can tell: planning the file as values misses by more than the tolerance
        assert!(
            report.start_allocated.abs_diff(planned_values) > tolerance,
            "{case}: the values plan ({:.1} MiB) is within the tolerance too",
            mib(planned_values)
        );
        // a long prefill (the int4 experts streamed, dense GEMMs through the dequantization scratch),
        // then decode steps replayed from graphs, within the plan
        let (prefill, peak) = super::full_prefill_then_decode(&e);
        assert!(prefill.iter().all(|x| x.is_finite()), "{case}: logits");
        println!(
            "{case}: peak {:.1} MiB, plan total {:.1} MiB",
            mib(peak),
            mib(report.plan.total())
        );
        if peak > report.plan.total() + (64 << 20) {
            failures.push(format!(
                "{case}: peak {:.1} MiB above the plan's {:.1} MiB",
                mib(peak),
                mib(report.plan.total())
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
