//! CUDA graphs of the engine stream: a run of launches captured once and replayed with one launch
//! (decode steps' per-layer segments; see the daemon's `engine::gpu::graphs`).
use super::{GpuDevice, GpuError};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

/// A captured and instantiated graph of the engine stream's work.
pub struct CapturedGraph(CudaGraph);

// SAFETY: `CudaGraph` is `!Send` because it holds raw driver handles, which the driver lets any thread
// use once the context is bound (replay binds it). What the driver forbids is *concurrent* use of one
// graph, and `CapturedGraph` is not `Sync` and replays through `&self` only: moving it to another
// thread (the engine thread that owns the model may change between steps) is sound.
unsafe impl Send for CapturedGraph {}

impl CapturedGraph {
    /// Enqueues the captured work on the stream it was captured from.
    pub fn replay(&self) -> Result<(), GpuError> {
        Ok(self.0.launch()?)
    }
}

impl GpuDevice {
    /// Runs `f` with the engine stream in capture mode and returns its result with the graph it
    /// enqueued. The capture ends whatever `f` returns, so the stream is usable afterwards; the graph is
    /// `Ok(None)` when nothing was captured. Relaxed mode: the thread-local mode refused a call of the
    /// decode segment on the H200 ("operation not permitted when stream is capturing").
    pub fn capture<T>(
        &self,
        f: impl FnOnce() -> T,
    ) -> Result<(T, Result<Option<CapturedGraph>, GpuError>), GpuError> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let out = f();
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map(|g| g.map(CapturedGraph))
            .map_err(GpuError::from);
        Ok((out, graph))
    }
}
