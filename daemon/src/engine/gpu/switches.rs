//! Run-time switches of the hybrid decode step: each changes how a step is scheduled, not what the
//! engine holds, so a benchmark can turn it on and off between steps of the same sequences in one
//! process (`bench decode --ab`) instead of comparing two runs with their noise. Read once per step
//! (relaxed atomics: a change lands at the next step).
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub struct DecodeSwitches {
    /// Routes per token whose CPU experts decode steps may defer to the next layer (0: exact;
    /// `--defer-experts`).
    defer_experts: AtomicUsize,
    /// Enqueue the GPU half of all-DRAM MoE layers (and the next segment) before their routing lands
    /// in pipelined steps (`forward`); on unless `MOE_GPU_PRELAUNCH=0`.
    prelaunch: AtomicBool,
    /// Mixed decode layers (resident and DRAM experts, host-planned) multiply their GPU experts with
    /// the grouped kernel instead of the rule's cuBLAS batched call: the host launches them before it
    /// starts the CPU experts, so the launch cost (cuBLAS's per-call heuristics and pointer table)
    /// delays the CPU side. On unless `MOE_MIXED_GROUPED=0`; `MOE_GROUPED_GEMM` forcing a path wins.
    mixed_grouped: AtomicBool,
    /// Pipelined graph steps skip the pre-step capture walk when a step of the same rows, routes and
    /// placement was walked (`graphs::WalkMark`); on by default (off: every step walks, as before).
    walk_mark: AtomicBool,
    /// A pipelined step whose last layer is enqueued before its routing lands enqueues the step's
    /// head (final norm, lm_head) with it, before the last CPU experts run; on by default (off: after
    /// them, as before).
    early_head: AtomicBool,
    /// A prelaunched layer whose experts all live in DRAM hands the routing as it landed to its CPU
    /// half (no dispatch plan), which runs at once when the next segment is enqueued already; on by
    /// default (off: planned, and run at the next layer's start, as before).
    direct_half: AtomicBool,
    /// The decode segment's fused kernels (`moe_kernels::cuda::ops::segment`): q/k/v as one GEMV,
    /// norm, RoPE and the K/V append as one launch, attention over warps, the router's GEMV, top-k and
    /// publish as one launch, where the shapes allow; off: cuBLAS and the separate kernels, as before.
    /// On unless `MOE_GPU_SEGMENT=old` ([`GPU_SEGMENT_KNOB`]).
    fused_segment: AtomicBool,
    /// With the fused segment: the attention norm folded into the q/k/v GEMV's launch and the FFN
    /// norm into the router's (each block normalises the rows itself); off: separate `rms_norm`
    /// launches, as before. On by default.
    fold_norms: AtomicBool,
    /// With the fused segment: the attention's o projection of 1–2 rows by the segment's bf16 GEMV
    /// (a warp per 2048 inputs of a row) instead of cuBLAS. Off by default.
    o_gemv: AtomicBool,
    /// Pipelined (decode) steps hand a share of each layer's routed DRAM experts to the GPU, which
    /// copies them from the registered expert memory and computes them beside the CPU experts
    /// (`decode_split`): off, the share the measured rates give, or a fixed count per layer.
    /// `MOE_DECODE_SPLIT` ([`DECODE_SPLIT_KNOB`]); off by default (not faster on the H200: the
    /// share's launches cost what it saves the CPU, docs/PERF.md).
    decode_split: AtomicUsize,
    /// Pipelined steps fetch the next layer's segment weights into L2 (`l2_prefetch`) before the GPU
    /// waits for the CPU experts (`GpuModel::prefetch_segment`). Off by default: on the H200 at the
    /// GLM-4.5-Air shape it shortened the segment by 0.6 µs in the bench and the engine's window by
    /// 1–4 µs of ~93, within the rounds' noise, for four more host launches per layer (docs/PERF.md).
    l2_prefetch: AtomicBool,
}

/// A decode split's share of a layer's routed DRAM experts ([`DecodeSwitches`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeShare {
    Off,
    /// As many as `split::DecodeBalance` gives.
    Auto,
    /// This many per layer (the CPU keeps at least one).
    Fixed(usize),
}

impl DecodeShare {
    /// Most experts per layer a fixed share names.
    pub const MAX_FIXED: usize = 16;

    fn encode(self) -> usize {
        match self {
            DecodeShare::Off => 0,
            DecodeShare::Auto => usize::MAX,
            DecodeShare::Fixed(n) => n,
        }
    }

    fn decode(v: usize) -> Self {
        match v {
            0 => DecodeShare::Off,
            usize::MAX => DecodeShare::Auto,
            n => DecodeShare::Fixed(n),
        }
    }
}

/// `MOE_DECODE_SPLIT`: `off` (the default), `auto`, or a fixed count of experts per layer (1–16),
/// read at start.
pub const DECODE_SPLIT_KNOB: moe_kernels::knob::Knob<DecodeShare> = moe_kernels::knob::Knob {
    name: "MOE_DECODE_SPLIT",
    takes: "off, auto or 1..16",
    parse: parse_decode_split,
};

fn parse_decode_split(v: &str) -> Option<DecodeShare> {
    match v {
        "off" | "0" => Some(DecodeShare::Off),
        "auto" => Some(DecodeShare::Auto),
        n => match n.parse::<usize>() {
            Ok(n) if (1..=DecodeShare::MAX_FIXED).contains(&n) => Some(DecodeShare::Fixed(n)),
            _ => None,
        },
    }
}

/// `MOE_GPU_SEGMENT`: `fused` (the default) or `old` (the decode segment on cuBLAS and the separate
/// kernels), read at start.
pub const GPU_SEGMENT_KNOB: moe_kernels::knob::Knob<bool> = moe_kernels::knob::Knob {
    name: "MOE_GPU_SEGMENT",
    takes: "fused or old",
    parse: parse_gpu_segment,
};

fn parse_gpu_segment(v: &str) -> Option<bool> {
    match v {
        "fused" => Some(true),
        "old" => Some(false),
        _ => None,
    }
}

impl Default for DecodeSwitches {
    fn default() -> Self {
        let off = |var: &str| std::env::var_os(var).is_some_and(|v| v == "0");
        DecodeSwitches {
            defer_experts: AtomicUsize::new(0),
            prelaunch: AtomicBool::new(!off("MOE_GPU_PRELAUNCH")),
            mixed_grouped: AtomicBool::new(!off("MOE_MIXED_GROUPED")),
            walk_mark: AtomicBool::new(true),
            early_head: AtomicBool::new(true),
            direct_half: AtomicBool::new(true),
            fused_segment: AtomicBool::new(GPU_SEGMENT_KNOB.read_or(true)),
            fold_norms: AtomicBool::new(true),
            o_gemv: AtomicBool::new(false),
            decode_split: AtomicUsize::new(DECODE_SPLIT_KNOB.read_or(DecodeShare::Off).encode()),
            l2_prefetch: AtomicBool::new(false),
        }
    }
}

impl DecodeSwitches {
    pub fn defer_experts(&self) -> usize {
        self.defer_experts.load(Ordering::Relaxed)
    }

    pub fn set_defer_experts(&self, routes: usize) {
        self.defer_experts.store(routes, Ordering::Relaxed);
    }

    pub fn prelaunch(&self) -> bool {
        self.prelaunch.load(Ordering::Relaxed)
    }

    pub fn set_prelaunch(&self, on: bool) {
        self.prelaunch.store(on, Ordering::Relaxed);
    }

    pub fn mixed_grouped(&self) -> bool {
        self.mixed_grouped.load(Ordering::Relaxed)
    }

    pub fn set_mixed_grouped(&self, on: bool) {
        self.mixed_grouped.store(on, Ordering::Relaxed);
    }

    pub fn walk_mark(&self) -> bool {
        self.walk_mark.load(Ordering::Relaxed)
    }

    pub fn set_walk_mark(&self, on: bool) {
        self.walk_mark.store(on, Ordering::Relaxed);
    }

    pub fn early_head(&self) -> bool {
        self.early_head.load(Ordering::Relaxed)
    }

    pub fn set_early_head(&self, on: bool) {
        self.early_head.store(on, Ordering::Relaxed);
    }

    pub fn direct_half(&self) -> bool {
        self.direct_half.load(Ordering::Relaxed)
    }

    pub fn set_direct_half(&self, on: bool) {
        self.direct_half.store(on, Ordering::Relaxed);
    }

    pub fn fused_segment(&self) -> bool {
        self.fused_segment.load(Ordering::Relaxed)
    }

    pub fn set_fused_segment(&self, on: bool) {
        self.fused_segment.store(on, Ordering::Relaxed);
    }

    pub fn fold_norms(&self) -> bool {
        self.fold_norms.load(Ordering::Relaxed)
    }

    pub fn set_fold_norms(&self, on: bool) {
        self.fold_norms.store(on, Ordering::Relaxed);
    }

    pub fn o_gemv(&self) -> bool {
        self.o_gemv.load(Ordering::Relaxed)
    }

    pub fn set_o_gemv(&self, on: bool) {
        self.o_gemv.store(on, Ordering::Relaxed);
    }

    pub fn decode_split(&self) -> DecodeShare {
        DecodeShare::decode(self.decode_split.load(Ordering::Relaxed))
    }

    pub fn set_decode_split(&self, share: DecodeShare) {
        self.decode_split.store(share.encode(), Ordering::Relaxed);
    }

    pub fn l2_prefetch(&self) -> bool {
        self.l2_prefetch.load(Ordering::Relaxed)
    }

    pub fn set_l2_prefetch(&self, on: bool) {
        self.l2_prefetch.store(on, Ordering::Relaxed);
    }
}

/// Every A/B knob the engine reads from the environment (its own and the CPU expert kernels'), checked
/// before anything runs: a value a knob does not take is an error naming it, never its default in
/// silence (`moe_kernels::knob`).
pub fn check_env_knobs() -> Result<(), moe_kernels::knob::KnobError> {
    super::attention::FLASH_PREFILL_KNOB.check()?;
    GPU_SEGMENT_KNOB.check()?;
    DECODE_SPLIT_KNOB.check()?;
    moe_kernels::cpu::moe::check_env_knobs()
}

/// A switch of the decode step by name, for benchmarks' A/B runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeSwitch {
    /// CUDA graphs of the pre-expert segments (paused: eager launches on the same buffers).
    Graphs,
    /// Resident experts of small steps from the device routing (`routed`).
    DeviceRouted,
    /// All-DRAM layers' GPU half enqueued before the routing lands.
    Prelaunch,
    /// Grouped expert GEMMs in mixed decode layers.
    MixedGrouped,
    /// The capture walk's mark (pipelined graph steps skip a walk done before).
    WalkMark,
    /// The step's head enqueued with a prelaunched last layer.
    EarlyHead,
    /// All-DRAM prelaunched layers' CPU half from the routing as it landed, run at once.
    DirectHalf,
    /// Deferred experts: this many routes per token (not exact).
    Defer(usize),
    /// The decode segment's fused kernels.
    FusedSegment,
    /// The engine thread takes CPU expert items in the pool's regions (off: it opens each region and
    /// waits while the other workers take them all; `WorkerPool::set_caller_works`).
    CallerWorks,
    /// One core of the CPU expert pool left to the OS: its worker kept out of the regions, asleep
    /// (`WorkerPool::set_spare_cores`).
    SpareCore,
    /// The norms folded into the fused segment's q/k/v and router launches.
    FoldNorms,
    /// The fused segment's o projection by its GEMV instead of cuBLAS.
    OGemv,
    /// Decode steps hand the GPU the share of each layer's DRAM experts the rates give.
    DecodeSplit,
    /// Decode steps hand the GPU this many of each layer's DRAM experts.
    DecodeSplitFixed(usize),
    /// The next layer's segment weights prefetched into L2 while the GPU waits for the host.
    L2Prefetch,
}

impl DecodeSwitch {
    /// Whether the switch changes the model's output beyond f32 summation order (deferred experts
    /// do: an expert's output lands one layer late).
    pub fn inexact(self) -> bool {
        matches!(self, DecodeSwitch::Defer(_))
    }
}

impl std::str::FromStr for DecodeSwitch {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "graphs" => DecodeSwitch::Graphs,
            "device-routed" => DecodeSwitch::DeviceRouted,
            "prelaunch" => DecodeSwitch::Prelaunch,
            "mixed-grouped" => DecodeSwitch::MixedGrouped,
            "walk-mark" => DecodeSwitch::WalkMark,
            "early-head" => DecodeSwitch::EarlyHead,
            "direct-half" => DecodeSwitch::DirectHalf,
            "fused-segment" => DecodeSwitch::FusedSegment,
            "caller-works" => DecodeSwitch::CallerWorks,
            "spare-core" => DecodeSwitch::SpareCore,
            "fold-norms" => DecodeSwitch::FoldNorms,
            "o-gemv" => DecodeSwitch::OGemv,
            "l2-prefetch" => DecodeSwitch::L2Prefetch,
            "decode-split" => DecodeSwitch::DecodeSplit,
            _ => {
                let numbered = |prefix: &str, most: usize| match s.strip_prefix(prefix) {
                    Some(n) => n.parse::<usize>().ok().filter(|n| (1..=most).contains(n)),
                    None => None,
                };
                if let Some(n) = numbered("decode-split", DecodeShare::MAX_FIXED) {
                    DecodeSwitch::DecodeSplitFixed(n)
                } else if let Some(n) = numbered("defer", 64) {
                    DecodeSwitch::Defer(n)
                } else {
                    return Err(format!(
                        "unknown decode switch {s:?} (graphs, device-routed, prelaunch, mixed-grouped, walk-mark, early-head, direct-half, fused-segment, fold-norms, o-gemv, l2-prefetch, caller-works, spare-core, defer1..defer64, decode-split, decode-split1..decode-split16)"
                    ));
                }
            }
        })
    }
}

impl std::fmt::Display for DecodeSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeSwitch::Graphs => f.write_str("graphs"),
            DecodeSwitch::DeviceRouted => f.write_str("device-routed"),
            DecodeSwitch::Prelaunch => f.write_str("prelaunch"),
            DecodeSwitch::MixedGrouped => f.write_str("mixed-grouped"),
            DecodeSwitch::WalkMark => f.write_str("walk-mark"),
            DecodeSwitch::EarlyHead => f.write_str("early-head"),
            DecodeSwitch::DirectHalf => f.write_str("direct-half"),
            DecodeSwitch::Defer(n) => write!(f, "defer{n}"),
            DecodeSwitch::FusedSegment => f.write_str("fused-segment"),
            DecodeSwitch::CallerWorks => f.write_str("caller-works"),
            DecodeSwitch::SpareCore => f.write_str("spare-core"),
            DecodeSwitch::FoldNorms => f.write_str("fold-norms"),
            DecodeSwitch::OGemv => f.write_str("o-gemv"),
            DecodeSwitch::DecodeSplit => f.write_str("decode-split"),
            DecodeSwitch::DecodeSplitFixed(n) => write!(f, "decode-split{n}"),
            DecodeSwitch::L2Prefetch => f.write_str("l2-prefetch"),
        }
    }
}

/// Benchmarks' view of the switches (every GPU of a tensor-parallel group alike).
impl crate::engine::Engine {
    /// Whether `switch` is on now; `None` without the CUDA backend, or for CUDA graphs when the
    /// engine captures none (`--no-cuda-graphs`, hybrid-attention models without
    /// `--cuda-graphs-hybrid`).
    pub fn decode_switch(&self, switch: DecodeSwitch) -> Option<bool> {
        let g = self.gpu.as_ref()?;
        Some(match switch {
            DecodeSwitch::Graphs if !g.cuda_graphs => return None,
            DecodeSwitch::Graphs => !g.graphs_paused.load(Ordering::Relaxed),
            DecodeSwitch::DeviceRouted => g.device_routed.load(Ordering::Relaxed),
            DecodeSwitch::Prelaunch => g.switches.prelaunch(),
            DecodeSwitch::MixedGrouped => g.switches.mixed_grouped(),
            DecodeSwitch::WalkMark => g.switches.walk_mark(),
            DecodeSwitch::EarlyHead => g.switches.early_head(),
            DecodeSwitch::DirectHalf => g.switches.direct_half(),
            DecodeSwitch::Defer(n) => g.switches.defer_experts() == n,
            DecodeSwitch::FusedSegment => g.switches.fused_segment(),
            DecodeSwitch::CallerWorks => self.cpu_pool.as_deref()?.caller_works(),
            DecodeSwitch::SpareCore => self.cpu_pool.as_deref()?.spare_cores() > 0,
            DecodeSwitch::FoldNorms => g.switches.fold_norms(),
            DecodeSwitch::OGemv => g.switches.o_gemv(),
            DecodeSwitch::DecodeSplit => g.switches.decode_split() == DecodeShare::Auto,
            DecodeSwitch::DecodeSplitFixed(n) => g.switches.decode_split() == DecodeShare::Fixed(n),
            DecodeSwitch::L2Prefetch => g.switches.l2_prefetch(),
        })
    }

    /// Turns `switch` on or off from the next step on (deferred experts: off is the exact path).
    /// Returns whether the engine has it (see [`Engine::decode_switch`]).
    ///
    /// [`Engine::decode_switch`]: crate::engine::Engine::decode_switch
    pub fn set_decode_switch(&self, switch: DecodeSwitch, on: bool) -> bool {
        if self.decode_switch(switch).is_none() {
            return false;
        }
        // the CPU expert pool's switches (the spare core: refused by pools of several NUMA groups
        // or too few threads)
        let applied = match (switch, self.cpu_pool.as_deref()) {
            (DecodeSwitch::CallerWorks, Some(pool)) => {
                pool.set_caller_works(on);
                true
            }
            (DecodeSwitch::SpareCore, Some(pool)) => pool.set_spare_cores(usize::from(on)),
            _ => true,
        };
        if !applied {
            return false;
        }
        // the decode split's GPU side is set up when the split is first switched on
        if let (DecodeSwitch::DecodeSplit | DecodeSwitch::DecodeSplitFixed(_), true) = (switch, on)
        {
            for g in self.gpus() {
                if let Err(e) = g.ensure_decode_share(&self.model) {
                    tracing::warn!("decode split unavailable: {e:#}");
                    return false;
                }
            }
        }
        for g in self.gpus() {
            match switch {
                DecodeSwitch::Graphs => g.graphs_paused.store(!on, Ordering::Relaxed),
                DecodeSwitch::DeviceRouted => g.set_device_routed(on),
                DecodeSwitch::Prelaunch => g.switches.set_prelaunch(on),
                DecodeSwitch::MixedGrouped => g.switches.set_mixed_grouped(on),
                DecodeSwitch::WalkMark => g.switches.set_walk_mark(on),
                DecodeSwitch::EarlyHead => g.switches.set_early_head(on),
                DecodeSwitch::DirectHalf => g.switches.set_direct_half(on),
                DecodeSwitch::Defer(n) => g.switches.set_defer_experts(if on { n } else { 0 }),
                DecodeSwitch::FusedSegment => g.switches.set_fused_segment(on),
                DecodeSwitch::CallerWorks | DecodeSwitch::SpareCore => {} // the pool's, set above
                DecodeSwitch::FoldNorms => g.switches.set_fold_norms(on),
                DecodeSwitch::OGemv => g.switches.set_o_gemv(on),
                DecodeSwitch::DecodeSplit | DecodeSwitch::DecodeSplitFixed(_) => {
                    let share = match (switch, on) {
                        (_, false) => DecodeShare::Off,
                        (DecodeSwitch::DecodeSplitFixed(n), true) => DecodeShare::Fixed(n),
                        _ => DecodeShare::Auto,
                    };
                    g.switches.set_decode_split(share)
                }
                DecodeSwitch::L2Prefetch => g.switches.set_l2_prefetch(on),
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switch_names_round_trip_and_bad_ones_are_refused() {
        for s in [
            "graphs",
            "device-routed",
            "prelaunch",
            "mixed-grouped",
            "walk-mark",
            "early-head",
            "direct-half",
            "fused-segment",
            "caller-works",
            "spare-core",
            "fold-norms",
            "o-gemv",
            "l2-prefetch",
            "defer1",
            "defer2",
            "decode-split",
            "decode-split2",
            "decode-split16",
        ] {
            let parsed: DecodeSwitch = s.parse().unwrap();
            assert_eq!(parsed.to_string(), s);
        }
        assert_eq!("defer3".parse(), Ok(DecodeSwitch::Defer(3)));
        assert_eq!(
            "decode-split3".parse(),
            Ok(DecodeSwitch::DecodeSplitFixed(3))
        );
        for bad in [
            "defer0",
            "defer",
            "deferx",
            "graph",
            "",
            "defer65",
            "decode-split0",
            "decode-split17",
            "decode-splitx",
        ] {
            assert!(bad.parse::<DecodeSwitch>().is_err(), "{bad}");
        }
        assert!(DecodeSwitch::Defer(1).inexact());
        assert!(!DecodeSwitch::MixedGrouped.inexact());
    }

    #[test]
    fn the_flash_prefill_knob_takes_its_values_and_refuses_others() {
        use moe_kernels::cuda::ops::flash_attention::FlashBlock;
        let knob = &super::super::attention::FLASH_PREFILL_KNOB;
        let v = |s: &str| knob.parse_value(Some(s.into()));
        assert_eq!(v("0"), Ok(Some(None)));
        assert_eq!(v("1"), Ok(Some(Some(FlashBlock::Warps4))));
        assert_eq!(v("w8"), Ok(Some(Some(FlashBlock::Warps8))));
        let e = v("on").unwrap_err();
        assert!(e.to_string().starts_with("MOE_FLASH_PREFILL=\"on\""), "{e}");
        if std::env::var_os(knob.name).is_none() {
            assert_eq!(knob.check(), Ok(None));
        }
    }

    #[test]
    fn switches_change_between_steps() {
        let s = DecodeSwitches::default();
        assert_eq!(s.defer_experts(), 0);
        s.set_defer_experts(2);
        assert_eq!(s.defer_experts(), 2);
        s.set_prelaunch(false);
        assert!(!s.prelaunch());
        s.set_mixed_grouped(false);
        assert!(!s.mixed_grouped());
        assert!(s.walk_mark());
        s.set_walk_mark(false);
        assert!(!s.walk_mark());
        assert!(s.early_head());
        s.set_early_head(false);
        assert!(!s.early_head());
        assert!(s.direct_half());
        s.set_direct_half(false);
        assert!(!s.direct_half());
        s.set_fused_segment(false);
        assert!(!s.fused_segment());
        assert!(s.fold_norms());
        s.set_fold_norms(false);
        assert!(!s.fold_norms());
        assert!(!s.o_gemv());
        s.set_o_gemv(true);
        assert!(s.o_gemv());
        s.set_decode_split(DecodeShare::Fixed(2));
        assert_eq!(s.decode_split(), DecodeShare::Fixed(2));
        s.set_decode_split(DecodeShare::Auto);
        assert_eq!(s.decode_split(), DecodeShare::Auto);
        s.set_decode_split(DecodeShare::Off);
        assert_eq!(s.decode_split(), DecodeShare::Off);
    }

    #[test]
    fn decode_split_knob_takes_off_auto_or_a_count() {
        let parse = |v: &str| DECODE_SPLIT_KNOB.parse_value(Some(v.into()));
        assert_eq!(parse("off"), Ok(Some(DecodeShare::Off)));
        assert_eq!(parse("0"), Ok(Some(DecodeShare::Off)));
        assert_eq!(parse("auto"), Ok(Some(DecodeShare::Auto)));
        assert_eq!(parse("3"), Ok(Some(DecodeShare::Fixed(3))));
        for bad in ["17", "on", "-1"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(parse(" "), Ok(None), "blank: unset");
    }

    #[test]
    fn gpu_segment_knob_takes_fused_or_old_only() {
        let parse = |v: &str| GPU_SEGMENT_KNOB.parse_value(Some(v.into()));
        assert_eq!(GPU_SEGMENT_KNOB.parse_value(None), Ok(None));
        assert_eq!(parse("fused"), Ok(Some(true)));
        assert_eq!(parse(" old "), Ok(Some(false)));
        let e = parse("new").unwrap_err().to_string();
        assert!(
            e.contains("MOE_GPU_SEGMENT") && e.contains("fused or old"),
            "{e}"
        );
    }
}
