//! Routed experts that live in DRAM, packed for the CPU kernels of `moe_kernels::cpu::moe`
//! (AMX / AVX-512 / AVX2 / scalar, chosen at run time) and run by their persistent pinned worker pool.
//!
//! Packing happens once, after placement: each MoE layer's remaining (non-GPU) experts are repacked
//! into the kernel layout (optionally quantized to int8 / int4) and the checkpoint-layout copies are
//! dropped, so one copy of every expert stays in memory.
use crate::engine::linear::{Linear, WeightData};
use crate::model::{Ffn, Model};
use anyhow::Context;
use moe_kernels::cpu::moe::{
    CpuExpertSet, ExpertSetConfig, ExpertSource, SourceTensor, WeightFormat,
};
use moe_kernels::cpu::{CpuMoeOptions, WorkerPool};

/// The FP8 block size the kernels read scales for.
const KERNEL_FP8_BLOCK: usize = 128;

/// `Some(format)` forces a format; `None` keeps the checkpoint's (bf16, FP8 with 128×128 blocks, GGML
/// blocks in the int format that holds them).
pub fn pick_format(forced: Option<WeightFormat>, sample: &Linear) -> WeightFormat {
    if let Some(f) = forced {
        return f;
    }
    match &sample.w {
        WeightData::F8 { block, .. } if *block == KERNEL_FP8_BLOCK => WeightFormat::Fp8Block,
        WeightData::Ggml { kind, .. } => moe_kernels::cpu::moe::format_for_ggml(*kind),
        _ => WeightFormat::Bf16,
    }
}

/// Packs every MoE layer's DRAM experts into a [`CpuExpertSet`] and releases their checkpoint copies.
/// `layer_formats[layer]` (from placement rules) overrides `forced` for that layer.
pub fn pack_model(
    model: &mut Model,
    pool: &WorkerPool,
    opts: &CpuMoeOptions,
    forced: Option<WeightFormat>,
    layer_formats: &[Option<WeightFormat>],
) -> anyhow::Result<()> {
    let cfg = model.config.clone();
    let Some(mc) = &cfg.moe else { return Ok(()) };
    let act = crate::engine::moe::GatedAct::of(&cfg).kernel_activation();
    for (li, layer) in model.layers.iter_mut().enumerate() {
        let Ffn::Moe(block) = &mut layer.ffn else {
            continue;
        };
        let ids: Vec<u32> = (0..block.experts.len() as u32)
            .filter(|&e| block.experts[e as usize].is_some())
            .collect();
        let Some(first) = ids
            .first()
            .and_then(|&e| block.experts[e as usize].as_ref())
        else {
            continue;
        };
        let format = pick_format(
            layer_formats.get(li).copied().flatten().or(forced),
            &first.gate,
        );
        let set_cfg = ExpertSetConfig::new(cfg.hidden_size, mc.expert_intermediate, format)
            .with_activation(act, cfg.swiglu_limit)
            .with_hugepages(opts.hugepages)
            .with_max_tier(opts.max_tier);
        // FP8 with a block size other than the kernels' 128 stays on the exact reference path.
        let odd_fp8 = ids.iter().any(|&e| {
            let m = block.experts[e as usize].as_ref().expect("filtered above");
            [&m.gate, &m.up, &m.down]
                .iter()
                .any(|l| matches!(&l.w, WeightData::F8 { block, .. } if *block != KERNEL_FP8_BLOCK))
        });
        if odd_fp8 {
            tracing::warn!(
                "layer {li}: FP8 blocks are not 128x128; experts stay on the reference CPU path"
            );
            continue;
        }
        let sources: Vec<ExpertSource> = ids
            .iter()
            .map(|&e| {
                let m = block.experts[e as usize].as_ref().expect("filtered above");
                ExpertSource {
                    gate: source(&m.gate),
                    up: source(&m.up),
                    down: source(&m.down),
                }
            })
            .collect();
        let set = CpuExpertSet::new(&set_cfg, &ids, &sources, pool)
            .with_context(|| format!("packing layer {li} experts for the CPU kernels"))?;
        drop(sources);
        for &e in &ids {
            block.experts[e as usize] = None;
        }
        block.cpu_set = Some(set);
    }
    Ok(())
}

/// What the kernels read for one checkpoint tensor (routed experts are never densely packed).
fn source(l: &Linear) -> SourceTensor<'_> {
    l.source()
        .expect("routed experts stay in checkpoint form until packed here")
}
