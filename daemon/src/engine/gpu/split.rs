//! Mid-length prompts with experts in DRAM: each MoE layer's routed DRAM experts split between the GPU
//! and the CPU kernels, computed at the same time.
//!
//! At a few hundred tokens neither side alone reaches the hardware: the CPU kernels read every routed
//! expert from DRAM (nearly all of a layer's experts are routed at 512 tokens) at their DRAM rate, and
//! streaming all of them to the GPU is bound by PCIe. Split, both links carry weights at once. Once a
//! layer's routing lands, its routed DRAM experts are ranked by rows (the most-loaded first: the GPU's
//! GEMMs gain most on them, and the CPU keeps the experts it reads for few rows) and the first share go
//! to the GPU through the expert stream (`stream`, chunks issued for this layer only), the rest to the
//! CPU pool; the GPU adds the CPU's sum as in every hybrid step. The share is chosen so that both sides
//! finish together, from rates measured on earlier layers ([`SplitBalance`]): the GPU side's bytes
//! over the time from its first copy to its last GEMM (GPU events), the CPU side's bytes over its
//! kernels' wall time. Exact: every expert is computed once, on one side, as placements do.
//!
//! Steps from [`GpuModel::split_min_rows`] rows up to the long-prefill threshold split; longer ones
//! stream every DRAM expert (`stream`), shorter ones keep them on the CPU.
use cudarc::driver::{CudaEvent, CudaStream};

/// Default fewest rows of a step whose DRAM experts are split (below it the CPU reads few rows per
/// expert and the GPU side's fixed costs per layer weigh more).
pub const DEFAULT_MIN_ROWS: usize = 128;

/// Each side keeps at least this share of the routed experts, so that both rates stay measured.
const MIN_SHARE: f64 = 0.05;
/// Weight of a new measurement in the running rates.
const EWMA: f64 = 0.3;
/// Starting rates in bytes per second until the first layers are measured: pinned copies on PCIe 5
/// (55 GB/s on the H200 host, less the unpack and GEMMs behind them), and the CPU kernels at about
/// 2/3 of a 125 GB/s DRAM read bandwidth (docs/PERF.md).
const START_GPU_RATE: f64 = 45e9;
const START_CPU_RATE: f64 = 80e9;
/// Observations of fewer bytes than this say more about fixed costs than rates: ignored.
const MIN_OBSERVED_BYTES: usize = 64 << 20;

/// The running rates of both sides and the GPU side of the last split layer, not read yet.
pub struct SplitBalance {
    gpu_rate: f64,
    cpu_rate: f64,
    pending: Option<GpuSpan>,
    /// Layers measured on each side.
    pub gpu_layers: u64,
    pub cpu_layers: u64,
}

/// The GPU side of one layer: from the event before its first copy to the one after its last GEMM.
pub struct GpuSpan {
    pub start: CudaEvent,
    pub end: CudaEvent,
    pub bytes: usize,
}

impl Default for SplitBalance {
    fn default() -> Self {
        Self {
            gpu_rate: START_GPU_RATE,
            cpu_rate: START_CPU_RATE,
            pending: None,
            gpu_layers: 0,
            cpu_layers: 0,
        }
    }
}

impl SplitBalance {
    /// The share of a layer's routed expert bytes the GPU takes: both sides then finish together.
    pub fn gpu_share(&self) -> f64 {
        (self.gpu_rate / (self.gpu_rate + self.cpu_rate)).clamp(MIN_SHARE, 1.0 - MIN_SHARE)
    }

    /// Rates in bytes per second (GPU, CPU).
    pub fn rates(&self) -> (f64, f64) {
        (self.gpu_rate, self.cpu_rate)
    }

    fn blend(rate: &mut f64, bytes: usize, secs: f64) -> bool {
        if bytes < MIN_OBSERVED_BYTES || secs <= 0.0 {
            return false;
        }
        *rate = (1.0 - EWMA) * *rate + EWMA * (bytes as f64 / secs);
        true
    }

    /// The CPU side of a layer computed `bytes` of experts in `secs`.
    pub fn observe_cpu(&mut self, bytes: usize, secs: f64) {
        self.cpu_layers += u64::from(Self::blend(&mut self.cpu_rate, bytes, secs));
    }

    /// The GPU side of a layer took `secs` for `bytes`.
    pub fn observe_gpu(&mut self, bytes: usize, secs: f64) {
        self.gpu_layers += u64::from(Self::blend(&mut self.gpu_rate, bytes, secs));
    }

    /// Keeps a layer's GPU span to read once its events have passed (a later layer).
    pub fn pend_gpu(&mut self, span: GpuSpan) {
        self.pending = Some(span);
    }

    /// Reads the pending GPU span if its end has passed (without waiting).
    pub fn collect_gpu(&mut self) -> anyhow::Result<()> {
        let Some(span) = &self.pending else {
            return Ok(());
        };
        if !span.end.try_is_complete()? {
            return Ok(());
        }
        let span = self.pending.take().expect("checked above");
        let ms = span.start.elapsed_ms(&span.end)?;
        self.observe_gpu(span.bytes, f64::from(ms) / 1e3);
        Ok(())
    }

    /// Records an event on `stream` (the start or end of a GPU span).
    pub fn event(stream: &CudaStream) -> anyhow::Result<CudaEvent> {
        use cudarc::driver::sys::CUevent_flags;
        Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }
}

/// Decode steps (`decode_split`): how many of a layer's routed DRAM experts the GPU takes, from both
/// sides' measured rates and fixed costs. A decode layer moves few bytes (one to eight experts), so
/// the fixed costs weigh: the GPU side's (unpack, GEMMs and the sum's copy back: its span beyond the
/// copies) and the host's launches of it, which delay the CPU experts (measured ~120 µs per share on
/// the H200, as much as two bf16 experts save the CPU: docs/PERF.md). Each side's time is modelled as
/// `fixed + bytes / rate`, the CPU's rate lowered by [`DECODE_CPU_CONTENTION`] while the GPU copies;
/// the rates and the launch time follow what each layer measured (the GPU side's span from its first
/// copy to its sum landing, by GPU events; the CPU experts' wall time, its contention taken out when
/// the layer had a share), the other fixed costs are constants.
#[derive(Clone, Debug)]
pub struct DecodeBalance {
    gpu_rate: f64,
    cpu_rate: f64,
    /// The host's launches of a GPU share (measured, running mean).
    launch_s: f64,
    pub gpu_layers: u64,
    pub cpu_layers: u64,
}

/// The GPU side's span beyond its copies at batch 1: unpack, GEMMs, the sum's copy back.
const DECODE_GPU_FIXED_S: f64 = 40e-6;
/// The CPU experts' time beyond reading their bytes (the pool's region, the sum).
const DECODE_CPU_FIXED_S: f64 = 15e-6;
/// The host's launches of a GPU share before the first measurement (~120 µs measured on the H200
/// host with bf16 and int8 experts).
const DECODE_START_LAUNCH_S: f64 = 120e-6;
/// The share of the CPU kernels' DRAM rate lost while the GPU copies experts beside them (14–18 %
/// measured by `bench decode --dma-probe` on the H200 host).
const DECODE_CPU_CONTENTION: f64 = 0.16;
/// Starting rates: a share's copies from registered memory to its sum, beside the CPU kernels (40.5
/// GB/s measured in decode steps on the H200 host, 42–44 by `--dma-probe`: PCIe's 55 less the CPU's
/// contention), the CPU kernels at batch 1 (103–133 GB/s there, docs/PERF.md).
const DECODE_START_GPU_RATE: f64 = 40e9;
const DECODE_START_CPU_RATE: f64 = 110e9;
/// A share is taken only when the model says the layer gets at least this much shorter.
const DECODE_MIN_GAIN: f64 = 0.03;

impl Default for DecodeBalance {
    fn default() -> Self {
        Self {
            gpu_rate: DECODE_START_GPU_RATE,
            cpu_rate: DECODE_START_CPU_RATE,
            launch_s: DECODE_START_LAUNCH_S,
            gpu_layers: 0,
            cpu_layers: 0,
        }
    }
}

impl DecodeBalance {
    /// The layer's time if the GPU takes `g` of `m` routed DRAM experts of `each` bytes: the later
    /// of both sides (the CPU starts after the host launched the GPU's share).
    fn layer_s(&self, g: usize, m: usize, each: usize) -> f64 {
        let cpu_bytes = ((m - g) * each) as f64;
        if g == 0 {
            return DECODE_CPU_FIXED_S + cpu_bytes / self.cpu_rate;
        }
        let cpu = DECODE_CPU_FIXED_S + cpu_bytes / (self.cpu_rate * (1.0 - DECODE_CPU_CONTENTION));
        let gpu = DECODE_GPU_FIXED_S + (g * each) as f64 / self.gpu_rate;
        gpu.max(self.launch_s + cpu)
    }

    /// How many of `m` routed DRAM experts of `each` bytes the GPU takes (at most `cap`, and the CPU
    /// keeps one): the count that makes the layer shortest, 0 unless that gains [`DECODE_MIN_GAIN`].
    pub fn gpu_count(&self, m: usize, each: usize, cap: usize) -> usize {
        let alone = self.layer_s(0, m, each);
        let best = (1..=cap.min(m.saturating_sub(1)))
            .map(|g| (g, self.layer_s(g, m, each)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        match best {
            Some((g, t)) if t < alone * (1.0 - DECODE_MIN_GAIN) => g,
            _ => 0,
        }
    }

    /// Rates in bytes per second (GPU, CPU) and the host's launch seconds.
    pub fn rates(&self) -> (f64, f64, f64) {
        (self.gpu_rate, self.cpu_rate, self.launch_s)
    }

    fn blend(rate: &mut f64, bytes: usize, secs: f64, fixed: f64) -> bool {
        // below a quarter of the time left for the bytes, the fixed cost did not hold: not a rate
        let left = secs - fixed;
        if bytes == 0 || left < secs / 4.0 {
            return false;
        }
        *rate = (1.0 - EWMA) * *rate + EWMA * (bytes as f64 / left);
        true
    }

    /// The GPU side of a layer moved `bytes` of experts in `secs` (first copy to sum landed).
    pub fn observe_gpu(&mut self, bytes: usize, secs: f64) {
        self.gpu_layers += u64::from(Self::blend(
            &mut self.gpu_rate,
            bytes,
            secs,
            DECODE_GPU_FIXED_S,
        ));
    }

    /// The CPU experts of a layer read `bytes` in `secs`, beside a GPU share when `shared` (the
    /// rate kept is the one without it).
    pub fn observe_cpu(&mut self, bytes: usize, secs: f64, shared: bool) {
        let slowed = if shared {
            1.0 - DECODE_CPU_CONTENTION
        } else {
            1.0
        };
        let mut rate = self.cpu_rate * slowed;
        let seen = Self::blend(&mut rate, bytes, secs, DECODE_CPU_FIXED_S);
        if seen {
            self.cpu_rate = rate / slowed;
        }
        self.cpu_layers += u64::from(seen);
    }

    /// The host took `secs` to launch a GPU share.
    pub fn observe_launch(&mut self, secs: f64) {
        self.launch_s = (1.0 - EWMA) * self.launch_s + EWMA * secs;
    }
}

/// The experts the GPU takes out of `routed` ((expert, rows) of the layer's routed DRAM experts that
/// may be streamed, every one of the same size): the `share` most-loaded (most rows first, lower id
/// first among equals), at least one and at most all but one when there are two or more. In
/// ascending id order (the stream's copy order: neighbours in memory go as one copy).
pub fn gpu_experts(routed: &[(u32, usize)], share: f64) -> Vec<u32> {
    let n = routed.len();
    if n == 0 {
        return Vec::new();
    }
    let take = ((n as f64 * share).round() as usize).clamp(1, n.saturating_sub(1).max(1));
    let mut ranked: Vec<(u32, usize)> = routed.iter().copied().filter(|&(_, r)| r > 0).collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut ids: Vec<u32> = ranked.into_iter().take(take).map(|(e, _)| e).collect();
    ids.sort_unstable();
    ids
}

/// Rows per expert of a layer's routing (`ids`, every route of every token), for the experts that
/// `eligible` accepts, as (expert, rows) in expert order.
pub fn routed_rows(
    ids: &[u32],
    experts: usize,
    eligible: impl Fn(usize) -> bool,
) -> Vec<(u32, usize)> {
    let mut rows = vec![0usize; experts];
    for &id in ids {
        if let Some(r) = rows.get_mut(id as usize) {
            *r += 1;
        }
    }
    rows.into_iter()
        .enumerate()
        .filter(|&(e, r)| r > 0 && eligible(e))
        .map(|(e, r)| (e as u32, r))
        .collect()
}

impl super::GpuModel {
    /// Whether a step of `rows` rows splits its layers' DRAM experts: from `split_min_rows` up to the
    /// long-prefill threshold, not in pipelined (decode) steps, whose GPU half may be enqueued before
    /// the routing, and on one GPU (a tensor-parallel group divides experts by rank).
    pub(super) fn split_step(&self, long_prompt: bool, pipelined: bool, rows: usize) -> bool {
        !long_prompt
            && !pipelined
            && self.split_min_rows > 0
            && !self.split_paused.load(std::sync::atomic::Ordering::Relaxed)
            && rows >= self.split_min_rows
            && self.shard.is_none()
    }
}

impl crate::engine::Engine {
    /// Pauses (or resumes) the split of mid-length prompts' DRAM experts; false when this engine never
    /// splits (CPU backend, split off, no expert stream).
    pub fn pause_split(&self, paused: bool) -> bool {
        let Some(g) = &self.gpu else { return false };
        g.split_paused
            .store(paused, std::sync::atomic::Ordering::Relaxed);
        let stream = g.stream.lock().unwrap_or_else(|e| e.into_inner());
        g.split_min_rows > 0 && stream.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_loaded_experts_go_to_the_gpu() {
        let routed = [(0, 3), (1, 9), (2, 1), (5, 9), (7, 4)];
        // 40 % of 5 experts: the two with 9 rows
        assert_eq!(gpu_experts(&routed, 0.4), vec![1, 5]);
        // 60 %: then expert 7 (4 rows); ascending id order
        assert_eq!(gpu_experts(&routed, 0.6), vec![1, 5, 7]);
        // never all: the CPU side keeps one so both rates stay measured
        assert_eq!(gpu_experts(&routed, 1.0).len(), 4);
        assert_eq!(gpu_experts(&routed, 0.0), vec![1], "at least one");
        assert_eq!(gpu_experts(&[(3, 2)], 0.5), vec![3], "a lone expert goes");
        assert!(gpu_experts(&[], 0.5).is_empty());
    }

    #[test]
    fn decode_shares_balance_both_sides_and_fixed_costs() {
        // one Qwen3-30B-A3B expert, bf16
        let each = 9_437_184;
        // as measured on the H200 (launches ~120 µs per share, copies at 40 GB/s beside the CPU):
        // the GPU takes none
        let measured = DecodeBalance::default();
        assert_eq!(measured.gpu_count(8, each, 8), 0);
        // launched cheaply: at 40 vs 110 GB/s (92 beside the copies) two go to the GPU (0.51 vs
        // 0.64 ms against 0.70 alone; three would keep the GPU busy 0.74 ms)
        let mut b = DecodeBalance::default();
        for _ in 0..40 {
            b.observe_launch(10e-6);
        }
        assert_eq!(b.gpu_count(8, each, 8), 2);
        // one alone saves the CPU less than the copies' contention costs it
        assert_eq!(b.gpu_count(8, each, 1), 0, "capped");
        assert_eq!(b.gpu_count(1, each, 8), 0, "the CPU keeps one");
        // a CPU rate seen beside a share is the contended one: the rate kept is the one without it
        let mut c = DecodeBalance::default();
        let contended = 110e9 * (1.0 - DECODE_CPU_CONTENTION);
        let secs = DECODE_CPU_FIXED_S + (6 * each) as f64 / contended;
        c.observe_cpu(6 * each, secs, true);
        assert!((c.rates().1 - 110e9).abs() < 1e6, "{:?}", c.rates());
        // tiny experts: the fixed costs outweigh what the GPU would save
        assert_eq!(b.gpu_count(8, 64 << 10, 8), 0);
        // a slow GPU side takes none
        let mut slow = DecodeBalance::default();
        for _ in 0..30 {
            slow.observe_gpu(each, DECODE_GPU_FIXED_S + each as f64 / 5e9);
        }
        assert!((slow.rates().0 - 5e9).abs() < 1e8, "{:?}", slow.rates());
        assert_eq!(slow.gpu_count(8, each, 8), 0);
        assert_eq!(slow.gpu_layers, 30);
        // observations the fixed cost swallows are no rate
        slow.observe_cpu(each, DECODE_CPU_FIXED_S, false);
        assert_eq!(slow.cpu_layers, 0);
        slow.observe_launch(1.0);
        assert!(slow.rates().2 > 0.2);
    }

    #[test]
    fn rows_are_counted_per_eligible_expert() {
        let ids = [0, 2, 2, 5, 2, 0, 9];
        assert_eq!(
            routed_rows(&ids, 8, |e| e != 5),
            vec![(0, 2), (2, 3)],
            "expert 5 not eligible, 9 out of range"
        );
    }

    #[test]
    fn the_share_follows_the_measured_rates() {
        let mut b = SplitBalance::default();
        let start = b.gpu_share();
        assert!((start - 45.0 / 125.0).abs() < 1e-9, "{start}");
        // the GPU side measured at 20 GB/s, the CPU at 80: its share falls toward 0.2
        for _ in 0..30 {
            b.observe_gpu(1 << 30, (1u64 << 30) as f64 / 20e9);
            b.observe_cpu(1 << 30, (1u64 << 30) as f64 / 80e9);
        }
        assert!((b.gpu_share() - 0.2).abs() < 1e-3, "{}", b.gpu_share());
        assert_eq!((b.gpu_layers, b.cpu_layers), (30, 30));
        // small observations are ignored, and the share never leaves [5 %, 95 %]
        b.observe_gpu(1 << 20, 1.0);
        assert_eq!(b.gpu_layers, 30);
        for _ in 0..50 {
            b.observe_cpu(1 << 30, 1e-9);
        }
        assert_eq!(b.gpu_share(), MIN_SHARE);
    }
}
