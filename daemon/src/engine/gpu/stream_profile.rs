//! Where a long prefill's expert stream loses time against PCIe, measured on the GPU's own clock
//! (diagnostic, off unless `MOE_STREAM_PROFILE=1` is set when the engine starts): per chunk, timing
//! events around its copies (copy stream) and its unpack (main stream), and the step's start and end.
//! At the end of each long-prefill step one line says how busy the copy engine was, at what rate, and
//! why it idled: a staging slot not yet freed by the main stream (compute-bound), or the copy not yet
//! issued by the host (host-bound); and on how many chunks the main stream waited for the copy
//! (PCIe-bound). Costs four event records per chunk and one synchronisation at the step's end.
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

/// The events of one chunk (all with timing).
struct ChunkEvents {
    copy_start: CudaEvent,
    copy_end: CudaEvent,
    unpack_start: CudaEvent,
    unpack_end: CudaEvent,
    bytes: usize,
    layer: usize,
}

/// One step's events.
pub(super) struct StreamProfile {
    ctx: Arc<CudaContext>,
    step_start: Option<CudaEvent>,
    chunks: Vec<ChunkEvents>,
}

/// Whether the environment asks for the profile.
pub(super) fn wanted() -> bool {
    std::env::var_os("MOE_STREAM_PROFILE").is_some_and(|v| v == "1")
}

impl StreamProfile {
    pub(super) fn new(ctx: Arc<CudaContext>) -> StreamProfile {
        StreamProfile {
            ctx,
            step_start: None,
            chunks: Vec::new(),
        }
    }

    fn event(&self) -> anyhow::Result<CudaEvent> {
        Ok(self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// A step starts on `main`.
    pub(super) fn begin(&mut self, main: &CudaStream) -> anyhow::Result<()> {
        let e = self.event()?;
        e.record(main)?;
        self.step_start = Some(e);
        self.chunks.clear();
        Ok(())
    }

    /// Chunk `c`'s copies are about to be enqueued on `copy` (after its wait for the slot).
    pub(super) fn copy_start(
        &mut self,
        c: usize,
        layer: usize,
        copy: &CudaStream,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(c == self.chunks.len(), "chunk {c} profiled out of order");
        let ev = ChunkEvents {
            copy_start: self.event()?,
            copy_end: self.event()?,
            unpack_start: self.event()?,
            unpack_end: self.event()?,
            bytes: 0,
            layer,
        };
        ev.copy_start.record(copy)?;
        self.chunks.push(ev);
        Ok(())
    }

    pub(super) fn copy_end(
        &mut self,
        c: usize,
        bytes: usize,
        copy: &CudaStream,
    ) -> anyhow::Result<()> {
        let ev = &mut self.chunks[c];
        ev.bytes = bytes;
        Ok(ev.copy_end.record(copy)?)
    }

    pub(super) fn unpack(&self, c: usize, main: &CudaStream, end: bool) -> anyhow::Result<()> {
        let ev = &self.chunks[c];
        let e = if end {
            &ev.unpack_end
        } else {
            &ev.unpack_start
        };
        Ok(e.record(main)?)
    }

    /// Ends the step on `main` (waits for it) and prints the summary.
    pub(super) fn report(&mut self, main: &CudaStream) -> anyhow::Result<()> {
        let Some(start) = self.step_start.take() else {
            return Ok(());
        };
        let end = self.event()?;
        end.record(main)?;
        end.synchronize()?;
        let at = |e: &CudaEvent| -> anyhow::Result<f64> { Ok(start.elapsed_ms(e)? as f64) };
        let wall = at(&end)?;
        let mut t = Vec::with_capacity(self.chunks.len());
        for ev in &self.chunks {
            t.push(ChunkTimes {
                copy: (at(&ev.copy_start)?, at(&ev.copy_end)?),
                unpack: (at(&ev.unpack_start)?, at(&ev.unpack_end)?),
                layer: ev.layer,
            });
        }
        let bytes: usize = self.chunks.iter().map(|c| c.bytes).sum();
        let summary = summarize(&t, wall, bytes, super::stream::SLOTS);
        eprintln!("{summary}");
        tracing::info!("{summary}");
        Ok(())
    }
}

/// One chunk's times, ms from the step's start.
pub(super) struct ChunkTimes {
    /// Its copies' start and end (copy stream).
    pub copy: (f64, f64),
    /// Its unpack's start and end (main stream).
    pub unpack: (f64, f64),
    pub layer: usize,
}

/// The summary line of one step from its chunks' times, the step's wall time and bytes copied, with
/// `slots` staging slots. Main-stream time between two unpacks is the previous chunk's GEMMs when both
/// chunks are of one layer, and that plus the next layer's attention and routing hand-off (and the
/// host's planning of that layer) across a layer boundary; a wait for the next chunk's copy is
/// counted apart (the unpack started the moment the copy ended).
pub(super) fn summarize(t: &[ChunkTimes], wall: f64, bytes: usize, slots: usize) -> String {
    // within this much, two events count as "the same moment" (event resolution is ~0.5 µs)
    const SAME: f64 = 0.02;
    let busy: f64 = t.iter().map(|c| c.copy.1 - c.copy.0).sum();
    let unpack: f64 = t.iter().map(|c| c.unpack.1 - c.unpack.0).sum();
    let (mut slot_wait, mut issue_wait, mut pcie_bound) = (0.0, 0.0, 0);
    let (mut in_layer, mut across, mut copy_wait) = (0.0, 0.0, 0.0);
    let mut prev_end = 0.0;
    for (c, ch) in t.iter().enumerate() {
        let (cs, ce) = ch.copy;
        let idle = (cs - prev_end).max(0.0);
        // the copy started when the main stream freed its slot: it was waiting for that
        let freed = c.checked_sub(slots).map(|p| t[p].unpack.1);
        if freed.is_some_and(|f| (cs - f).abs() < SAME && f > prev_end) {
            slot_wait += idle;
        } else {
            issue_wait += idle;
        }
        prev_end = ce;
        let waited = (ch.unpack.0 - ce).abs() < SAME;
        pcie_bound += usize::from(waited);
        if let Some(p) = c.checked_sub(1).map(|p| &t[p]) {
            let gap = (ch.unpack.0 - p.unpack.1).max(0.0);
            // a wait for this copy: the part of the gap after the main stream's own work, unknown;
            // counted whole as a copy wait when the unpack started right at the copy's end
            if waited && ce > p.unpack.1 {
                copy_wait += gap;
            } else if p.layer == ch.layer {
                in_layer += gap;
            } else {
                across += gap;
            }
        }
    }
    let tail = (wall - prev_end).max(0.0);
    format!(
        "expert stream: {} chunks, {:.2} GB copied in {:.1} ms of copy time ({:.1} GB/s while copying) over a {:.1} ms step; copy engine idle {:.1} ms waiting for a free slot (main stream behind), {:.1} ms waiting for the host to issue, {:.1} ms after the last copy; main stream: unpack {:.1} ms, between chunks of a layer (GEMMs) {:.1} ms, across layers (GEMMs, attention, hand-off) {:.1} ms, waiting for copies {:.1} ms (on {} of {} chunks)",
        t.len(),
        bytes as f64 / 1e9,
        busy,
        bytes as f64 / 1e6 / busy.max(1e-9),
        wall,
        slot_wait,
        issue_wait,
        tail,
        unpack,
        in_layer,
        across,
        copy_wait,
        pcie_bound,
        t.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_tells_slot_waits_from_issue_waits() {
        // two slots; chunk 2 starts the moment chunk 0's unpack ends (slot wait of 1 ms), chunk 3
        // starts 2 ms after chunk 2's copy and long after chunk 1 was unpacked (issue wait)
        let ch = |c: (f64, f64), u: (f64, f64), layer| ChunkTimes {
            copy: c,
            unpack: u,
            layer,
        };
        let t = [
            ch((0.0, 4.0), (4.0, 9.0), 0),
            ch((4.0, 8.0), (9.5, 10.0), 0),
            ch((9.0, 13.0), (13.5, 14.0), 1),
            ch((15.0, 19.0), (19.0, 20.0), 1),
        ];
        let s = summarize(&t, 21.0, 4_000_000_000, 2);
        assert!(s.contains("4 chunks, 4.00 GB copied in 16.0 ms"), "{s}");
        assert!(s.contains("250.0 GB/s"), "{s}");
        assert!(s.contains("idle 1.0 ms waiting for a free slot"), "{s}");
        assert!(s.contains("2.0 ms waiting for the host"), "{s}");
        assert!(s.contains("2.0 ms after the last copy"), "{s}");
        // unpacks 5 + 0.5 + 0.5 + 1; gaps: 0.5 in layer 0, 3.5 across, 5.0 waiting for chunk 3's copy
        assert!(s.contains("unpack 7.0 ms, between chunks of a layer (GEMMs) 0.5 ms, across layers (GEMMs, attention, hand-off) 3.5 ms, waiting for copies 5.0 ms (on 2 of 4 chunks)"), "{s}");
    }
}
