//! Routed experts that live in DRAM, packed for the CPU kernels of `moe_kernels::cpu::moe`
//! (AMX / AVX-512 / AVX2 / scalar, chosen at run time) and run by their persistent pinned worker pool.
//!
//! Packing happens once, after placement: each MoE layer's remaining (non-GPU) experts are repacked
//! into the kernel layout (optionally quantized to int8 / int4) and the checkpoint-layout copies are
//! dropped, so one copy of every expert stays in memory. Then the packed memory is settled on huge
//! pages where the system allows and what backs it is logged (see [`settle_pages`]).
use crate::engine::linear::{Linear, WeightData};
use crate::model::{Ffn, Model};
use anyhow::Context;
use moe_kernels::cpu::memory::{backing_of, collapse_to_huge_pages, HugeBuffer};
use moe_kernels::cpu::moe::{
    CpuExpertSet, ExpertSetConfig, ExpertSource, SourceTensor, WeightFormat,
};
use moe_kernels::cpu::{CpuMoeOptions, HugepageMode, PageBacking, WorkerPool};

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
    // one call scratch for every layer's set (they run one after the other)
    let mut scratch: Option<moe_kernels::cpu::moe::SharedScratch> = None;
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
        let set = match &scratch {
            Some(s) => set.with_scratch(s.clone()),
            None => {
                scratch = Some(set.scratch());
                set
            }
        };
        drop(sources);
        for &e in &ids {
            block.experts[e as usize] = None;
        }
        block.cpu_set = Some(set);
    }
    settle_pages(model, pool, opts.hugepages);
    Ok(())
}

/// The packed expert sets of every MoE layer.
fn cpu_sets(model: &Model) -> impl Iterator<Item = &CpuExpertSet> {
    model.layers.iter().filter_map(|l| match &l.ffn {
        Ffn::Moe(b) => b.cpu_set.as_ref(),
        _ => None,
    })
}

/// A pool this large on 4 KiB pages is worth a warning (smaller ones: tests, tiny models).
const WARN_SMALL_PAGES_BYTES: u64 = 1 << 30;
/// Share of the packed experts on 4 KiB pages above which the warning is given.
const WARN_SMALL_PAGES_FRACTION: f64 = 0.10;

/// After packing (the first touch of the expert memory, madvised for THP): collapses what THP left on
/// 4 KiB pages into huge pages, and logs what backs the packed experts and what that cost. With reserved
/// pages (hugetlb) there is nothing to collapse; with `--hugepages off` nothing is tried (nor warned).
fn settle_pages(model: &Model, pool: &WorkerPool, mode: HugepageMode) {
    let buffers: Vec<&HugeBuffer> = cpu_sets(model).flat_map(|s| s.buffers()).collect();
    if buffers.is_empty() {
        return;
    }
    let before = backing_of(buffers.iter().copied());
    let collapse = collapse_to_huge_pages(&buffers, pool);
    let after = match backing_of(buffers.iter().copied()) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!("packed DRAM experts: page backing unknown (/proc/self/smaps: {e})");
            return;
        }
    };
    if collapse.ranges > 0 {
        let before = before.map_or("unknown".to_string(), |b| b.to_string());
        let how = if collapse.unsupported {
            "not available (MADV_COLLAPSE needs Linux 6.1)".to_string()
        } else {
            format!(
                "{} of {} 2 MiB ranges refused, {} not tried",
                collapse.failed, collapse.ranges, collapse.skipped
            )
        };
        tracing::info!(
            "packed DRAM experts: THP collapse after packing took {:.2} s ({how}); before it {before}",
            collapse.seconds
        );
    }
    tracing::info!("packed DRAM experts: {after}");
    if mode != HugepageMode::Off
        && after.small >= WARN_SMALL_PAGES_BYTES
        && after.small_fraction() > WARN_SMALL_PAGES_FRACTION
    {
        tracing::warn!(
            "{:.1} GiB of the packed DRAM experts sit on 4 KiB pages: each 4 KiB of an expert read can \
             miss the TLB, and decode reads every chosen expert once per token. Reserve 2 MiB pages \
             before start (echo {} > /proc/sys/vm/nr_hugepages; a pod: resources hugepages-2Mi) or \
             enable transparent hugepages (madvise or always in \
             /sys/kernel/mm/transparent_hugepage/enabled)",
            after.small as f64 / (1u64 << 30) as f64,
            hugepages_2m_for(&buffers)
        );
    }
}

/// 2 MiB pages that would hold `buffers` (each rounded up on its own, as it is mapped).
fn hugepages_2m_for(buffers: &[&HugeBuffer]) -> usize {
    buffers.iter().map(|b| b.len().div_ceil(2 << 20)).sum()
}

impl crate::engine::Engine {
    /// What backs the packed DRAM experts now (`/proc/self/smaps`, read on each call: benchmarks,
    /// reports); `None` when no experts are packed for the CPU kernels.
    pub fn expert_page_backing(&self) -> Option<std::io::Result<PageBacking>> {
        let mut sets = cpu_sets(&self.model).peekable();
        sets.peek()?;
        Some(backing_of(sets.flat_map(|s| s.buffers())))
    }
}

/// What the kernels read for one checkpoint tensor (routed experts are never densely packed).
fn source(l: &Linear) -> SourceTensor<'_> {
    l.source()
        .expect("routed experts stay in checkpoint form until packed here")
}
