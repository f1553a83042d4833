//! Host→device copies of the packed DRAM experts kept running beside other work (`bench decode
//! --dma-probe`): whether the GPU reading expert bytes over PCIe adds to what the CPU kernels read
//! from DRAM or takes from it, measured with the engine's own kernels and probe. The copies are the
//! ones a split step makes (`split`): from the registered packed memory the CPU kernels read, on the
//! expert stream's copy stream, into its staging slots (idle outside long-prefill and split steps).
use super::stream::{copy_runs, ExpertStream};
use crate::model::Model;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use moe_kernels::cuda::GpuDevice;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Bytes of one copy at most: ~1 ms of PCIe, so that the copies left queued when the load stops
/// overrun what it ran beside by a few ms only.
const COPY_BYTES: usize = 64 << 20;
/// Copies queued at most; the thread issuing them sleeps between checks instead of spinning on a
/// core the CPU kernels use.
const IN_FLIGHT: usize = 8;
const CHECK_EVERY: Duration = Duration::from_millis(1);

/// What the copies moved: bytes over the span from before the first to after the last (GPU events).
#[derive(Clone, Copy, Debug, Default)]
pub struct CopyRate {
    pub bytes: usize,
    pub secs: f64,
}

impl CopyRate {
    pub fn gbs(&self) -> f64 {
        self.bytes as f64 / self.secs.max(1e-12) / 1e9
    }
}

/// The copies of every DRAM expert of every layer (host address, bytes, staging address), cycled.
struct CopyLoad {
    ctx: Arc<CudaContext>,
    copy: Arc<CudaStream>,
    copies: Vec<(usize, usize, u64)>,
}

impl ExpertStream {
    /// Every layer's DRAM experts as copies of at most [`COPY_BYTES`] (neighbours in memory merged)
    /// into the staging slots, in turn.
    fn copy_load(&self, dev: &GpuDevice, host: &Model) -> anyhow::Result<CopyLoad> {
        let each = self.geometry.expert_bytes;
        let per_copy = (COPY_BYTES / each.max(1)).clamp(1, self.chunk_experts);
        let mut copies = Vec::new();
        for (i, chunk) in self.all_chunks().iter().enumerate() {
            let set = super::stream::layer_set(host, chunk.layer)
                .ok_or_else(|| anyhow::anyhow!("layer {} lost its experts", chunk.layer))?;
            let base = self.staging_addr(dev, i);
            for ids in chunk.ids.chunks(per_copy) {
                let starts = ids
                    .iter()
                    .map(|&id| set.packed_expert(id).map(|b| b.as_ptr() as usize))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| anyhow::anyhow!("layer {} lost an expert", chunk.layer))?;
                for (src, len, off) in copy_runs(&starts, each) {
                    copies.push((src, len, base + off as u64));
                }
            }
        }
        anyhow::ensure!(!copies.is_empty(), "no DRAM expert to copy");
        Ok(CopyLoad {
            ctx: dev.ctx.clone(),
            copy: self.copy_stream().clone(),
            copies,
        })
    }
}

impl CopyLoad {
    /// Issues the copies in turn, at most [`IN_FLIGHT`] queued, until `stop`; then waits for them.
    fn run(&self, stop: &AtomicBool) -> anyhow::Result<CopyRate> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        self.ctx.bind_to_thread()?;
        let start = self.copy.record_event(Some(CU_EVENT_DEFAULT))?;
        let mut queued: VecDeque<CudaEvent> = VecDeque::new();
        let (mut next, mut bytes) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            if queued.len() < IN_FLIGHT {
                let (src, len, dst) = self.copies[next % self.copies.len()];
                // SAFETY: `src..src + len` is packed expert memory of the host model, alive while
                // the engine is (the caller holds it); `dst` lies inside a staging slot (a copy
                // never holds more experts than a chunk), which nothing reads in this span.
                unsafe {
                    let src = std::slice::from_raw_parts(src as *const u8, len);
                    cudarc::driver::result::memcpy_htod_async(dst, src, self.copy.cu_stream())?;
                }
                queued.push_back(self.copy.record_event(None)?);
                (next, bytes) = (next + 1, bytes + len);
            } else if queued
                .front()
                .map_or(Ok(false), CudaEvent::try_is_complete)?
            {
                queued.pop_front();
            } else {
                std::thread::sleep(CHECK_EVERY);
            }
        }
        let end = self.copy.record_event(Some(CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        let secs = f64::from(start.elapsed_ms(&end)?) / 1e3;
        Ok(CopyRate { bytes, secs })
    }
}

/// Raises the flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl crate::engine::Engine {
    /// Runs `f` on this thread while another keeps the GPU copying the packed DRAM experts from
    /// their registered memory (see the module docs); returns `f`'s result and the copies' rate.
    /// Fails without the CUDA backend's expert stream (no DRAM experts, or a format the GPU does
    /// not unpack).
    pub fn with_expert_copies<R>(&self, f: impl FnOnce() -> R) -> anyhow::Result<(R, CopyRate)> {
        let g = self
            .gpu
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("expert copies need the CUDA backend"))?;
        let stream = g.stream.lock().unwrap_or_else(|e| e.into_inner());
        let es = stream
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no expert stream (no DRAM experts the GPU unpacks)"))?;
        let load = es.copy_load(&g.dev, &self.model)?;
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let copier = s.spawn(|| load.run(&stop));
            let r = {
                // stops the copies however `f` ends (the scope joins the thread)
                let _stop = StopOnDrop(&stop);
                f()
            };
            let rate = copier
                .join()
                .map_err(|_| anyhow::anyhow!("the copy thread panicked"))??;
            Ok((r, rate))
        })
    }
}
