//! The GPU side of live re-placement (policy in [`crate::engine::replacement`]): copy a DRAM expert to
//! the GPU on a side stream while steps run, and swap it into its layer's table between two steps once
//! the copy has landed (an event says so; nothing waits for it).
//!
//! Cost on the engine thread per started move: a few driver calls (tens of µs). The expert's packed
//! bytes go by DMA straight from the CPU kernels' memory (registered with the driver at start by the
//! layerwise-prefill stream) into a staging buffer, the GPU unpacks them to bf16 (`unpack_experts`, the
//! kernel layerwise prefill uses) and copies the result into a spare expert buffer. Nothing is allocated
//! or freed while serving: the mover owns one spare buffer per copy slot, and an evicted expert's
//! buffers become the spare of the next copy (reused only after the step that last read them has
//! completed: a step ends by synchronizing the engine's stream, and swaps happen between steps).
//!
//! Formats the GPU does not unpack (int4 groups) are exported to bf16 on the engine thread instead
//! (a few ms per 9 MiB expert), and experts kept as checkpoint tensors rather than a packed set are
//! uploaded into fresh buffers.
use super::{upload_dram_expert_on, GpuFfn, GpuLinear, GpuMlp, GpuModel};
use crate::engine::replacement::Move;
use crate::model::{Ffn, Model};
use anyhow::Context;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use moe_kernels::cpu::moe::CpuExpertSet;
use moe_kernels::cuda::dense::DeviceDense;
use moe_kernels::cuda::ops::{ExpertUnpacker, UnpackFormat};
use std::sync::Arc;

struct InFlight {
    mv: Move,
    weights: GpuMlp,
    landed: CudaEvent,
}

/// Device buffers the packed copies go through (one of each: the side stream runs copies in order).
struct Unpacking {
    /// Packed bytes of one expert, as the CPU kernels hold them.
    packed: CudaSlice<u8>,
    /// One expert unpacked: gate_up `[2I, H]` then down `[H, I]`.
    dense: CudaSlice<bf16>,
}

/// Copies in flight on the side stream, and the spare expert buffers they land in.
pub struct ExpertMover {
    stream: Arc<CudaStream>,
    in_flight: Vec<InFlight>,
    /// Expert buffers in no table: destinations of the next copies (at most `slots`).
    spare: Vec<GpuMlp>,
    slots: usize,
    unpacking: Unpacking,
    unpack: ExpertUnpacker,
    /// `(hidden, inter)` of the routed experts.
    shape: (usize, usize),
}

/// The packed DRAM set of `layer`, if it has one.
fn cpu_set(host: &Model, layer: usize) -> Option<&CpuExpertSet> {
    match host.layers.get(layer).map(|l| &l.ffn) {
        Some(Ffn::Moe(b)) => b.cpu_set.as_ref(),
        _ => None,
    }
}

impl ExpertMover {
    /// A mover with `slots` spare expert buffers (the memory plan's "live moves").
    pub fn new(gpu: &GpuModel, host: &Model, slots: usize) -> anyhow::Result<Self> {
        let stream = gpu.dev.ctx.new_stream()?;
        let unpack = gpu.dev.expert_unpacker();
        let cfg = &host.config;
        let (h, i) = (
            cfg.hidden_size,
            cfg.moe.as_ref().map_or(0, |m| m.expert_intermediate),
        );
        let packed_bytes = (0..host.layers.len())
            .filter_map(|l| cpu_set(host, l))
            .map(|s| s.packed_geometry().expert_bytes)
            .max()
            .unwrap_or(0);
        let slots = slots.max(1);
        let spare = (0..slots)
            .map(|_| spare_expert(&stream, h, i))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // SAFETY (both): written by a copy or the unpack kernel before anything reads them.
        let unpacking = Unpacking {
            packed: unsafe { stream.alloc::<u8>(packed_bytes.max(1))? },
            dense: unsafe { stream.alloc::<bf16>((3 * h * i).max(1))? },
        };
        Ok(Self {
            stream,
            in_flight: Vec::new(),
            spare,
            slots,
            unpacking,
            unpack,
            shape: (h, i),
        })
    }

    /// Starts copying `mv.admit` of `mv.layer` from `host`'s DRAM copy into a spare buffer.
    pub fn start(&mut self, host: &Model, mv: Move) -> anyhow::Result<()> {
        let Some(Ffn::Moe(block)) = host.layers.get(mv.layer).map(|l| &l.ffn) else {
            anyhow::bail!("layer {} has no experts to move", mv.layer);
        };
        let what = || format!("copying layer {} expert {} to the GPU", mv.layer, mv.admit);
        let weights = if block.experts.get(mv.admit).is_some_and(Option::is_some) {
            // checkpoint tensors (no packed set): a fresh upload
            upload_dram_expert_on(&self.stream, block, mv.admit).with_context(what)?
        } else {
            let set = block.cpu_set.as_ref().with_context(what)?;
            let mut dst = self
                .spare
                .pop()
                .context("no spare expert buffer (more moves in flight than copy slots)")?;
            match self.copy_packed(set, mv.admit as u32, &mut dst) {
                Ok(()) => dst,
                Err(e) => {
                    self.spare.push(dst);
                    return Err(e.context(what()));
                }
            }
        };
        let landed = self.stream.record_event(None)?;
        self.in_flight.push(InFlight {
            mv,
            weights,
            landed,
        });
        Ok(())
    }

    /// Enqueues expert `id` of `set` into `dst` on the side stream: DMA of its packed bytes and unpack
    /// on the GPU, or (formats the GPU does not unpack) an export to bf16 here and a copy.
    fn copy_packed(&mut self, set: &CpuExpertSet, id: u32, dst: &mut GpuMlp) -> anyhow::Result<()> {
        let g = set.packed_geometry();
        let (h, i) = self.shape;
        anyhow::ensure!(
            (g.hidden, g.inter) == (h, i),
            "expert shape {}x{} differs from the mover's {h}x{i}",
            g.hidden,
            g.inter
        );
        let (gate_up, down) = bf16_parts(dst)?;
        if UnpackFormat::of(g.format).is_none() {
            let (gu, dn) = set.export_bf16(id).context("expert not in the DRAM set")?;
            let as_bf16 =
                |v: Vec<u16>| -> Vec<bf16> { v.into_iter().map(bf16::from_bits).collect() };
            self.stream.memcpy_htod(&as_bf16(gu), gate_up)?;
            self.stream.memcpy_htod(&as_bf16(dn), down)?;
            return Ok(());
        }
        let bytes = set
            .packed_expert(id)
            .context("expert not in the DRAM set")?;
        // The raw copy below does not bind the context itself (steps may run on any pool thread).
        self.stream.context().bind_to_thread()?;
        let u = &mut self.unpacking;
        anyhow::ensure!(
            bytes.len() <= u.packed.len(),
            "packed expert larger than staging"
        );
        let base = u.packed.device_ptr(&self.stream).0;
        // SAFETY: `bytes` is the host model's packed memory, alive as long as the engine (which owns the
        // GPU model and this mover); the destination is the staging buffer, large enough (checked). The
        // side stream orders this copy after the previous move's unpack read the staging buffer.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(base, bytes, self.stream.cu_stream())?;
        }
        self.unpack
            .unpack_on(&self.stream, &g, &u.packed, 1, &mut u.dense)?;
        let split = 2 * i * h;
        self.stream.memcpy_dtod(&u.dense.slice(..split), gate_up)?;
        self.stream
            .memcpy_dtod(&u.dense.slice(split..split + h * i), down)?;
        Ok(())
    }

    /// Swaps every landed copy into its table (call between steps); returns the landed moves, each
    /// with whether its swap happened (it fails when the residency changed meanwhile).
    pub fn swap_landed(
        &mut self,
        gpu: &GpuModel,
    ) -> anyhow::Result<Vec<(Move, anyhow::Result<()>)>> {
        let mut landed = Vec::new();
        let mut i = 0;
        while i < self.in_flight.len() {
            if !self.in_flight[i].landed.try_is_complete()? {
                i += 1;
                continue;
            }
            let f = self.in_flight.swap_remove(i);
            match gpu.swap_expert(f.mv.layer, f.mv.admit, f.mv.evict, f.weights) {
                Ok(evicted) => {
                    self.recycle(evicted);
                    landed.push((f.mv, Ok(())));
                }
                Err(refused) => {
                    let (e, weights) = *refused;
                    self.recycle(Some(weights));
                    landed.push((f.mv, Err(e)));
                }
            }
        }
        Ok(landed)
    }

    /// Keeps `m` as a spare if one is missing and it is a plain bf16 expert of the mover's shape (else
    /// frees it).
    fn recycle(&mut self, m: Option<GpuMlp>) {
        let Some(m) = m else { return };
        if self.spare.len() >= self.slots {
            return;
        }
        let (h, i) = self.shape;
        let fits = |l: &GpuLinear, len: usize| {
            l.bias.is_none() && l.w.as_bf16().is_some_and(|w| w.len() == len)
        };
        if fits(&m.gate_up, 2 * i * h) && fits(&m.down, h * i) {
            self.spare.push(m);
        }
    }

    /// Waits for every copy in flight and swaps them in (tests; shutting down cleanly).
    pub fn finish_all(
        &mut self,
        gpu: &GpuModel,
    ) -> anyhow::Result<Vec<(Move, anyhow::Result<()>)>> {
        self.stream.synchronize()?;
        self.swap_landed(gpu)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

/// An uninitialised bf16 expert of `hidden` × `inter` on `stream`.
fn spare_expert(stream: &Arc<CudaStream>, h: usize, i: usize) -> anyhow::Result<GpuMlp> {
    let linear = |out_dim: usize, in_dim: usize| -> anyhow::Result<GpuLinear> {
        // SAFETY: a spare is written by a whole-expert copy before any table holds it.
        let w = unsafe { stream.alloc::<bf16>((out_dim * in_dim).max(1))? };
        Ok(GpuLinear {
            w: DeviceDense::Bf16(w),
            bias: None,
            out_dim,
            in_dim,
        })
    };
    Ok(GpuMlp {
        gate_up: linear(2 * i, h)?,
        down: linear(h, i)?,
    })
}

/// The bf16 weights of a spare expert, to copy into.
fn bf16_parts(m: &mut GpuMlp) -> anyhow::Result<(&mut CudaSlice<bf16>, &mut CudaSlice<bf16>)> {
    match (&mut m.gate_up.w, &mut m.down.w) {
        (DeviceDense::Bf16(gu), DeviceDense::Bf16(d)) => Ok((gu, d)),
        _ => anyhow::bail!("spare expert buffers must be bf16"),
    }
}

impl GpuModel {
    /// Between steps: `admit` of `layer` becomes GPU-resident with `weights`, `evict` goes back to its
    /// DRAM copy. Returns the evicted expert's buffers (the caller reuses or frees them), or the error
    /// with `weights` back.
    pub fn swap_expert(
        &self,
        layer: usize,
        admit: usize,
        evict: usize,
        weights: GpuMlp,
    ) -> Result<Option<GpuMlp>, Box<(anyhow::Error, GpuMlp)>> {
        let moe = match self.layers.get(layer).map(|l| &l.ffn) {
            Some(GpuFfn::Moe(moe)) => moe,
            _ => {
                let e = anyhow::anyhow!("layer {layer} is not an MoE layer");
                return Err(Box::new((e, weights)));
            }
        };
        let resident = moe.experts.resident();
        if resident.get(admit) != Some(&false) || resident.get(evict) != Some(&true) {
            let e = anyhow::anyhow!(
                "layer {layer}: cannot swap expert {admit} in for {evict} (residency changed)"
            );
            return Err(Box::new((e, weights)));
        }
        Ok(moe.experts.replace(admit, evict, weights))
    }

    /// Per layer and expert: resident on the GPU now (empty rows for dense layers).
    pub fn residency(&self) -> Vec<Vec<bool>> {
        self.layers
            .iter()
            .map(|l| match &l.ffn {
                GpuFfn::Moe(m) => m.experts.resident(),
                GpuFfn::Dense(_) => Vec::new(),
            })
            .collect()
    }
}
