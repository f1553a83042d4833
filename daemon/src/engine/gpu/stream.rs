//! Layerwise prefill's expert stream: every DRAM expert of each MoE layer goes to the GPU once per long
//! prefill step, straight from the CPU kernels' packed memory.
//!
//! - The packed regions are registered (pinned) with the driver once, at start, so each copy is a DMA
//!   from the very bytes the CPU kernels read: no host-side staging copy, no second layout in RAM. Where
//!   registration is refused (locked-memory limits), copies still work from pageable memory, slower.
//! - A layer's experts go in chunks of `chunk_experts` (a few hundred MiB) through [`SLOTS`] device
//!   staging slots on a copy stream; the main stream unpacks a chunk (`unpack_experts`: packed tiles →
//!   dense bf16 `[gate; up]` and `down`) and runs its GEMMs while the copy stream fills the others. Chunks
//!   are issued ahead across layer boundaries, so the next layer's first chunk crosses PCIe while this
//!   layer (and the next one's attention) computes. All ordering is by events on the GPU: the host never
//!   waits for a copy.
//! - Every DRAM expert is sent, routed or not: with thousands of prompt tokens nearly all are, and sending
//!   all lets the copy start before the router has run.
//! - Steps that split each layer's experts between the GPU and the CPU (`split`) send only the experts
//!   a layer's routing gave the GPU, issued once that routing is known ([`ExpertStream::stream_layer`]).
use anyhow::Context;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use half::bf16;
use moe_kernels::cpu::moe::{CpuExpertSet, PackedGeometry};
use moe_kernels::cuda::ops::UnpackFormat;
use moe_kernels::cuda::GpuDevice;
use std::sync::Arc;

use crate::model::{Ffn, Model};

/// Default target bytes of one chunk (per staging slot; the dense copy is about as large): big enough
/// that per-copy and per-GEMM overheads vanish, small enough for any GPU's workspace.
pub const CHUNK_BYTES: usize = moe_sizing::plan::STREAM_CHUNK_BYTES as usize;

/// Experts per chunk for experts of `expert_bytes` bytes each.
pub fn chunk_experts(expert_bytes: usize, experts: usize, chunk_bytes: usize) -> usize {
    (chunk_bytes / expert_bytes.max(1)).clamp(1, experts.max(1))
}

/// Staging slots: copies run up to this many chunks ahead of the unpacking, so that at a layer boundary
/// (the last chunk's GEMMs, the next attention, the router hand-off) the copy engine has work queued.
/// Measured on the H200 (6-layer 4K prefill): 32–37 ms per layer with four slots, 32 ms with two, against
/// ~22 ms of PCIe; the slots are not what limits it (docs/PERF.md), four cost ~0.5 GiB more than two.
pub const SLOTS: usize = moe_sizing::plan::STREAM_SLOTS as usize;

/// Device bytes the stream holds (the memory plan's formula, shared with the operator).
pub fn device_bytes(dense_expert_bytes: usize, experts: usize, chunk_bytes: usize) -> usize {
    moe_sizing::plan::stream_staging_bytes(
        dense_expert_bytes as u64,
        experts as u64,
        chunk_bytes as u64,
    ) as usize
}

/// One chunk of one layer's DRAM experts.
#[derive(Clone, Debug)]
pub struct Chunk {
    pub layer: usize,
    /// Global expert ids, in the order they sit in staging and in the dense buffer.
    pub ids: Vec<u32>,
}

/// Host memory registered with the driver; unregistered on drop.
struct Registered(Vec<usize>);

impl Drop for Registered {
    fn drop(&mut self) {
        for &p in &self.0 {
            // SAFETY: `p` was registered by `cuMemHostRegister` and is still mapped (the engine drops the
            // GPU model before the host model that owns the memory).
            unsafe { cudarc::driver::sys::cuMemHostUnregister(p as *mut _) };
        }
    }
}

pub struct ExpertStream {
    copy: Arc<CudaStream>,
    staging: Vec<CudaSlice<u8>>,
    ready: Vec<CudaEvent>,
    free: Vec<CudaEvent>,
    pub dense: CudaSlice<bf16>,
    pub geometry: PackedGeometry,
    pub chunk_experts: usize,
    /// Every DRAM expert in chunks, layer by layer (fixed: the DRAM experts do not move).
    all_chunks: Vec<Chunk>,
    /// The chunks of this step: all of them, or those split steps issued layer by layer.
    chunks: Vec<Chunk>,
    /// Chunks of this step whose copies were enqueued / that were unpacked.
    issued: usize,
    consumed: usize,
    pinned: bool,
    _registered: Registered,
    /// Timing events of each step (`MOE_STREAM_PROFILE=1`; see `stream_profile`).
    profile: Option<super::stream_profile::StreamProfile>,
    /// The decode split's GPU side (`decode_split`), which borrows the first staging slot and the
    /// dense buffer in decode steps; set up when the split is first switched on.
    share: Option<super::decode_split::ShareSide>,
}

/// Whether a long prompt can bring layer `li`'s DRAM experts to the GPU cheaply: their packed format is
/// one the GPU unpacks (bf16, FP8 blocks, int8, int4 with or without group minimums), or the layer has
/// none packed. Other packed formats (f16, the grouped int8 of GGUF Q8_0 / Q5_K / Q6_K experts) would
/// be dequantized on the host expert by expert (minutes for a 4096-token prompt of a GLM-4.5-Air layer
/// set, measured), so such layers compute their DRAM experts on the CPU kernels in long prompts too.
pub fn gpu_can_take_dram_experts(host: &Model, li: usize) -> bool {
    layer_set(host, li).is_none_or(|s| UnpackFormat::of(s.packed_geometry().format).is_some())
}

/// The CPU expert set of layer `li`, if that layer keeps experts in DRAM.
pub(super) fn layer_set(host: &Model, li: usize) -> Option<&CpuExpertSet> {
    match &host.layers.get(li)?.ffn {
        Ffn::Moe(b) => b.cpu_set.as_ref(),
        _ => None,
    }
}

impl ExpertStream {
    /// Sets up streaming for `host`'s packed DRAM experts; `None` when no layer has any, or when their
    /// format is one the GPU does not unpack (those layers keep the per-expert upload path).
    pub fn new(
        dev: &GpuDevice,
        host: &Model,
        chunk_bytes: usize,
    ) -> anyhow::Result<Option<ExpertStream>> {
        let sets: Vec<(usize, &CpuExpertSet)> = (0..host.layers.len())
            .filter_map(|li| layer_set(host, li).map(|s| (li, s)))
            .collect();
        let Some(&(_, first)) = sets.first() else {
            return Ok(None);
        };
        let geometry = first.packed_geometry();
        if UnpackFormat::of(geometry.format).is_none()
            || sets.iter().any(|(_, s)| s.packed_geometry() != geometry)
        {
            tracing::info!(
                "layerwise prefill: expert format not unpacked on the GPU; uploading per expert"
            );
            return Ok(None);
        }
        let dense_each = geometry.dense_elems() * 2;
        let per_layer = sets
            .iter()
            .map(|(_, s)| s.expert_ids().len())
            .max()
            .unwrap_or(1);
        let chunk = chunk_experts(dense_each, per_layer, chunk_bytes);
        let layer_ids: Vec<(usize, &[u32])> =
            sets.iter().map(|(li, s)| (*li, s.expert_ids())).collect();
        let chunks = plan_chunks(&layer_ids, chunk);
        // Pin the packed regions once (cost: page pinning, about a second per 10-20 GiB).
        dev.ctx.bind_to_thread()?;
        let mut registered = Vec::new();
        let mut refused = None;
        for (_, s) in &sets {
            for r in s.packed_regions() {
                if r.is_empty() {
                    continue;
                }
                // SAFETY: a live mapping owned by the host model, which outlives this registration.
                let rc = unsafe {
                    cudarc::driver::sys::cuMemHostRegister_v2(r.as_ptr() as *mut _, r.len(), 0)
                };
                if rc == cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS {
                    registered.push(r.as_ptr() as usize);
                } else {
                    refused = Some(rc);
                }
            }
        }
        let pinned = refused.is_none();
        if let Some(rc) = refused {
            tracing::warn!(
                "layerwise prefill: pinning DRAM expert memory refused ({rc:?}); copies run from pageable memory, slower"
            );
        }
        let s = &dev.stream;
        let slot_bytes = chunk * geometry.expert_bytes;
        // SAFETY: staging is written by copies before any unpack reads it (events order them).
        let staging = (0..SLOTS)
            .map(|_| unsafe { s.alloc::<u8>(slot_bytes) })
            .collect::<Result<Vec<_>, _>>()?;
        // SAFETY: dense is written by `unpack_experts` before any GEMM reads it (same stream).
        let dense = unsafe { s.alloc::<bf16>(chunk * geometry.dense_elems())? };
        // The buffers come from the main stream's stream-ordered allocator; the copy stream may use
        // them only once that allocation has happened.
        s.synchronize()?;
        let ev = || dev.ctx.new_event(None);
        Ok(Some(ExpertStream {
            copy: dev.ctx.new_stream()?,
            staging,
            ready: (0..SLOTS).map(|_| ev()).collect::<Result<Vec<_>, _>>()?,
            free: (0..SLOTS).map(|_| ev()).collect::<Result<Vec<_>, _>>()?,
            dense,
            geometry,
            chunk_experts: chunk,
            all_chunks: chunks,
            chunks: Vec::new(),
            issued: 0,
            consumed: 0,
            pinned,
            _registered: Registered(registered),
            profile: super::stream_profile::wanted()
                .then(|| super::stream_profile::StreamProfile::new(dev.ctx.clone())),
            share: None,
        }))
    }

    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// Every DRAM expert in chunks, layer by layer.
    pub(super) fn all_chunks(&self) -> &[Chunk] {
        &self.all_chunks
    }

    /// The device address of staging slot `i % SLOTS` (one chunk's packed experts).
    pub(super) fn staging_addr(&self, dev: &GpuDevice, i: usize) -> u64 {
        dev.addr(&self.staging[i % SLOTS])
    }

    /// Sets up the decode split's side (`decode_split`) if it is not yet: its stream, buffers and
    /// warmed GEMMs. Between steps only (its warm-up waits for its own stream).
    pub(super) fn ensure_share(&mut self, dev: &GpuDevice, host: &Model) -> anyhow::Result<()> {
        if self.share.is_some() {
            return Ok(());
        }
        let top_k = host.config.moe.as_ref().map_or(1, |m| m.top_k);
        let act = crate::engine::moe::GatedAct::of(&host.config);
        // decode splits run at batch 1: one token's rows
        let (shape, rows) = ((&self.geometry, &self.dense), (1, top_k));
        let side = super::decode_split::ShareSide::new(dev, shape, rows, self.chunk_experts, act)?;
        self.share = Some(side);
        Ok(())
    }

    /// The decode split's side with the geometry, first staging slot and dense buffer it borrows.
    pub(super) fn share_and_buffers(
        &mut self,
    ) -> Option<(
        &mut super::decode_split::ShareSide,
        &PackedGeometry,
        &CudaSlice<u8>,
        &mut CudaSlice<bf16>,
    )> {
        let side = self.share.as_mut()?;
        Some((side, &self.geometry, &self.staging[0], &mut self.dense))
    }

    /// The stream the copies run on.
    pub(super) fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// Starts a step that streams: every DRAM expert (`all`: long prefill; the first chunks' copies
    /// are enqueued now), or only those [`ExpertStream::stream_layer`] adds (split steps).
    pub fn begin_step(&mut self, dev: &GpuDevice, host: &Model, all: bool) -> anyhow::Result<()> {
        // the decode split's side stream may still use the first staging slot and the dense buffer
        // (a decode step that failed before its last share joined)
        if let Some(side) = &self.share {
            side.synchronize()?;
        }
        self.issued = 0;
        self.consumed = 0;
        self.chunks.clear();
        if all {
            self.chunks.extend_from_slice(&self.all_chunks);
        }
        if let Some(p) = self.profile.as_mut() {
            p.begin(&dev.stream)?;
        }
        self.issue_ahead(dev, host)
    }

    /// Ends a long-prefill step: with profiling on, waits for the stream and prints where the copy
    /// engine's time went (`stream_profile`).
    pub fn end_step(&mut self, dev: &GpuDevice) -> anyhow::Result<()> {
        match self.profile.as_mut() {
            Some(p) => p.report(&dev.stream),
            None => Ok(()),
        }
    }

    /// Copies of the next chunks into free staging slots (at most `SLOTS` in flight or unconsumed).
    fn issue_ahead(&mut self, dev: &GpuDevice, host: &Model) -> anyhow::Result<()> {
        while self.issued < self.chunks.len() && self.issued < self.consumed + SLOTS {
            let slot = self.issued % SLOTS;
            let chunk = &self.chunks[self.issued];
            let set = layer_set(host, chunk.layer).context("streamed layer lost its experts")?;
            // The slot's previous chunk must be unpacked before it is overwritten.
            self.copy.wait(&self.free[slot])?;
            if let Some(p) = self.profile.as_mut() {
                p.copy_start(self.issued, chunk.layer, &self.copy)?;
            }
            let base = dev.addr(&self.staging[slot]);
            let each = self.geometry.expert_bytes;
            // Adjacent experts (consecutive in the packed buffer) go as one copy.
            let mut starts = Vec::with_capacity(chunk.ids.len());
            for &id in &chunk.ids {
                let bytes = set
                    .packed_expert(id)
                    .with_context(|| format!("expert {id} not in layer {}'s set", chunk.layer))?;
                starts.push(bytes.as_ptr() as usize);
            }
            for (src, len, off) in copy_runs(&starts, each) {
                // SAFETY: each run covers whole experts of the host model's live packed memory
                // (registered, or pageable); the destination lies inside the staging slot
                // (a chunk holds at most `chunk_experts` experts).
                unsafe {
                    let src = std::slice::from_raw_parts(src as *const u8, len);
                    cudarc::driver::result::memcpy_htod_async(
                        base + off as u64,
                        src,
                        self.copy.cu_stream(),
                    )?;
                }
            }
            if let Some(p) = self.profile.as_mut() {
                p.copy_end(self.issued, chunk.ids.len() * each, &self.copy)?;
            }
            self.ready[slot].record(&self.copy)?;
            self.issued += 1;
        }
        Ok(())
    }

    /// Adds layer `li`'s experts `ids` (ascending) to this step's stream and enqueues their copies as
    /// far as the staging slots allow; the event marks, on the copy stream, the moment before them.
    pub fn stream_layer(
        &mut self,
        dev: &GpuDevice,
        host: &Model,
        li: usize,
        ids: &[u32],
    ) -> anyhow::Result<CudaEvent> {
        let start = super::split::SplitBalance::event(&self.copy)?;
        self.chunks
            .extend(plan_chunks(&[(li, ids)], self.chunk_experts));
        self.issue_ahead(dev, host)?;
        Ok(start)
    }

    /// Bytes of one packed expert as the stream copies it.
    pub fn expert_bytes(&self) -> usize {
        self.geometry.expert_bytes
    }

    /// The chunks of layer `li` in this step, in order (indices for [`ExpertStream::take`]).
    pub fn layer_chunks(&self, li: usize) -> Vec<usize> {
        (0..self.chunks.len())
            .filter(|&c| self.chunks[c].layer == li)
            .collect()
    }

    /// Whether layer `li` has experts in the stream.
    pub fn has_layer(&self, li: usize) -> bool {
        self.chunks.iter().any(|c| c.layer == li)
    }

    pub fn chunk(&self, c: usize) -> &Chunk {
        &self.chunks[c]
    }

    /// Makes chunk `c` (the next unconsumed one) dense in `self.dense` on the main stream, frees its
    /// staging slot and issues the next copy. Expert `ids[j]` of the chunk is then at
    /// `j * geometry.dense_elems()`: gate_up `[2I, H]` followed by down `[H, I]`.
    pub fn take(&mut self, dev: &GpuDevice, host: &Model, c: usize) -> anyhow::Result<()> {
        anyhow::ensure!(
            c == self.consumed && c < self.issued,
            "expert stream out of order (chunk {c}, next {})",
            self.consumed
        );
        let slot = c % SLOTS;
        dev.stream.wait(&self.ready[slot])?;
        let count = self.chunks[c].ids.len();
        if let Some(p) = &self.profile {
            p.unpack(c, &dev.stream, false)?;
        }
        dev.unpack_experts(&self.geometry, &self.staging[slot], count, &mut self.dense)?;
        if let Some(p) = &self.profile {
            p.unpack(c, &dev.stream, true)?;
        }
        self.free[slot].record(&dev.stream)?;
        self.consumed += 1;
        self.issue_ahead(dev, host)
    }
}

/// Every layer's DRAM experts in chunks of at most `chunk`, layer by layer, in the order they are sent.
pub fn plan_chunks(layers: &[(usize, &[u32])], chunk: usize) -> Vec<Chunk> {
    let mut out = Vec::new();
    for &(layer, ids) in layers {
        for c in ids.chunks(chunk.max(1)) {
            out.push(Chunk {
                layer,
                ids: c.to_vec(),
            });
        }
    }
    out
}

/// Host copies for one chunk: experts `j` (host address `starts[j]`, `each` bytes) go to staging offset
/// `j * each`; experts that sit back to back in host memory merge into one (host start, bytes, staging
/// offset) copy.
pub fn copy_runs(starts: &[usize], each: usize) -> Vec<(usize, usize, usize)> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (j, &p) in starts.iter().enumerate() {
        match runs.last_mut() {
            Some((s, len, _)) if *s + *len == p => *len += each,
            _ => runs.push((p, each, j * each)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_layers_and_never_mix_them() {
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..7).collect(), vec![3, 9]);
        let c = plan_chunks(&[(1, &a), (4, &b)], 3);
        let got: Vec<(usize, Vec<u32>)> = c.iter().map(|c| (c.layer, c.ids.clone())).collect();
        assert_eq!(
            got,
            vec![
                (1, vec![0, 1, 2]),
                (1, vec![3, 4, 5]),
                (1, vec![6]),
                (4, vec![3, 9]),
            ]
        );
        assert_eq!(
            plan_chunks(&[(0, &a)], 0).len(),
            7,
            "chunk 0 is treated as 1"
        );
    }

    #[test]
    fn adjacent_experts_merge_into_one_copy() {
        // experts 0,1 adjacent; 2 after a gap; 3 adjacent to 2; 4 before them in memory
        let each = 100;
        let starts = [1000, 1100, 5000, 5100, 200];
        assert_eq!(
            copy_runs(&starts, each),
            vec![(1000, 200, 0), (5000, 200, 200), (200, 100, 400)]
        );
        assert!(copy_runs(&[], each).is_empty());
        // total bytes always equal experts × each, offsets dense
        let runs = copy_runs(&starts, each);
        assert_eq!(runs.iter().map(|r| r.1).sum::<usize>(), starts.len() * each);
    }

    #[test]
    fn chunk_size_and_device_bytes() {
        let each = 9 << 20; // one Qwen3-30B-A3B expert, bf16
        assert_eq!(chunk_experts(each, 128, CHUNK_BYTES), 28);
        assert_eq!(
            chunk_experts(each, 10, CHUNK_BYTES),
            10,
            "capped by the layer"
        );
        assert_eq!(
            chunk_experts(usize::MAX, 10, CHUNK_BYTES),
            1,
            "at least one"
        );
        let c = 28 * each;
        assert_eq!(device_bytes(each, 128, CHUNK_BYTES), c * SLOTS * 5 / 4 + c);
    }
}
