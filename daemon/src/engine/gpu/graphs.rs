//! Decode steps replayed as CUDA graphs.
//!
//! A decode step (every sequence adds one token) runs per layer the same dozen small kernels and GEMMs:
//! norm, q/k/v, rope, cache append, attention, output projection, norm, router, top-k, and the copies of
//! the routing to the host. At batch 1 each takes a few µs of GPU time but about as much host time to
//! launch, and the layer waits for all of them before its CPU experts can start. So that segment is
//! captured once per (layer, batch size) as a CUDA graph and replayed with one launch.
//!
//! A graph bakes in its buffer addresses and scalar arguments, so graph steps run on the decode class of
//! step buffers (`buffers`: allocated once for `MAX_GRAPH_ROWS` rows, never moved): the step's token
//! ids, positions, cache slots and block tables are copied into them before the replays, and the block
//! tables have a fixed stride (the most blocks one sequence can hold). In layers whose resident experts
//! are computed from the device routing (`routed`) the segment also holds the shared and resident
//! experts ([`SegmentTail`]); everything else of a layer (host-planned GPU experts, the CPU experts'
//! sum coming back) stays eager: it depends on the routing the host read. Steps that are not plain decode (prefill chunks, larger batches) and models
//! with plain MLA layers (DeepSeek-V3, GLM-4.7-Flash) run the same segment eagerly.
//!
//! Hybrid-attention models (GLM-5.3-Flash, GLM-5) are captured too: their per-step layout (segments,
//! recurrent-state addresses, streams, indexer rows and selection) lives in the class's hybrid buffers
//! (`hybrid_bufs`), written by `hybrid_begin_step` before the replays; the indexer derives each query's
//! candidate count from its position on the device. The hyper-connection expansion after the FFN stays
//! eager. `gpu_tests::glm_hybrid_gpu::glm_hybrid_cuda_graphs_match_eager` checks them.
//!
//! On by default in `serve`, `generate` and `bench` (`--no-cuda-graphs` turns them off), except for
//! hybrid-attention models, which replay graphs only with `--cuda-graphs-hybrid`: on the H200 their
//! graphs and eager launches decoded at the same speed (GLM-5.3-Flash shape, both in one process). Capture uses the
//! relaxed mode (the thread-local one refused a call of the segment on the H200) and no event
//! synchronisation inside the segment; a refused capture makes decode run eagerly from then on.
//! `gpu_tests::cuda_graph_decode_matches_eager` checks that graphs are captured and match eager steps.
//!
//! A step whose every MoE layer computes its experts from the device routing (every expert resident,
//! `routed`) never hands anything to the host between its embedding and its logits: its whole layer
//! stack (segments ending with their experts, dense MLPs) is captured as one graph per row count
//! ([`GraphSet::steps`]) and replayed with one launch, so the host enqueues three things per step
//! (index copies, one replay, the lm_head) and the GPU runs the layers back to back.
use super::routed::LayerRoute;
use super::{GpuFfn, GpuModel};
use moe_kernels::cuda::graph::CapturedGraph;
use std::collections::{HashMap, HashSet};

/// How a layer's segment ends after its router's top-k: what it hands to the host, and whether it
/// computes the experts itself (device-routed layers, `routed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentTail {
    /// The routing published to the host, with the normalised rows when `rows` (DRAM experts hit).
    Publish { rows: bool },
    /// Routing and rows published, then the shared and resident routed experts.
    PublishThenExperts,
    /// The shared and routed experts; nothing goes to the host.
    Experts,
}

/// A segment's graph: (layer, rows, its tail).
pub type SegmentKey = (usize, usize, SegmentTail);

/// The graphs captured so far: segment key → the pre-expert segment.
pub struct GraphSet {
    pub map: HashMap<SegmentKey, CapturedGraph>,
    /// Whole layer stacks of steps that never hand anything to the host (every MoE layer
    /// device-routed), by rows.
    pub steps: HashMap<usize, CapturedGraph>,
    /// A tensor-parallel GPU's segments in two halves around the attention's all-reduce: the same
    /// key, with 0 (norm and attention) or 1 (FFN norm, router, hand-off).
    pub halves: HashMap<(SegmentKey, u8), CapturedGraph>,
    /// A capture failed (a driver that refuses some captured call): decode runs eagerly from then on.
    pub broken: bool,
    /// Row counts whose every segment was captured by a step that waited for nothing while it
    /// captured ([`GraphSet::capture_pass`]); such steps may pipeline.
    pub ready_rows: HashSet<usize>,
    /// By rows: the layer plan of the last pipelined step whose pre-step capture walk found every
    /// segment captured. A later step of the same rows and plan skips the walk (48 layers' homes and
    /// keys, ~1 µs each, on the host before the step's first launch).
    walked: HashMap<usize, WalkMark>,
    /// The segment kernels these graphs hold (`switches`' `fused_segment` and `fold_norms`).
    kernels: SegmentKernels,
    /// The graphs of the other segment kernels, kept while these replay: `bench decode --ab
    /// fused-segment` flips between them step by step ([`GraphSet::select_kernels`]).
    parked: Vec<GraphSet>,
}

/// The kernels a step's segments run (a graph bakes them in): the fused segment's, and with them
/// whether the norms are folded into the q/k/v and router launches and whether the o projection is
/// the segment's GEMV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentKernels {
    pub fused: bool,
    pub fold_norms: bool,
    pub o_gemv: bool,
}

impl SegmentKernels {
    /// The switches' defaults.
    pub const DEFAULT: SegmentKernels = SegmentKernels {
        fused: true,
        fold_norms: true,
        o_gemv: false,
    };

    /// The kernels of the switches `fused_segment`, `fold_norms` and `o_gemv` (the last two need the
    /// fused kernels).
    pub fn of(fused: bool, fold_norms: bool, o_gemv: bool) -> SegmentKernels {
        SegmentKernels {
            fused,
            fold_norms: fused && fold_norms,
            o_gemv: fused && o_gemv,
        }
    }
}

/// What decides a pipelined step's segment keys besides its rows: each layer's route and the expert
/// placement (which layers' segments publish rows for the CPU). Graphs are never dropped from a set,
/// so a step with a mark equal to one that was walked finds every segment captured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalkMark {
    pub routes: Vec<LayerRoute>,
    /// [`GpuModel::placement_version`] when the step started.
    pub placement: u64,
}

impl GraphSet {
    /// Graphs captured so far (segments, tensor-parallel halves and whole steps), of both segment
    /// kernels.
    pub fn captured(&self) -> usize {
        let parked: usize = self.parked.iter().map(GraphSet::captured).sum();
        self.map.len() + self.halves.len() + self.steps.len() + parked
    }

    /// Makes the graphs of the segment kernels a step runs the current ones: a graph bakes in its
    /// kernels, so the other kernels' graphs are parked, not replayed, and come back when the
    /// switches flip back (a set starts empty, as the unfused one does the first time).
    pub fn select_kernels(&mut self, kernels: SegmentKernels) {
        if self.kernels == kernels {
            return;
        }
        let mut other = match self.parked.iter().position(|p| p.kernels == kernels) {
            Some(i) => self.parked.swap_remove(i),
            None => GraphSet {
                kernels,
                ..GraphSet::default()
            },
        };
        std::mem::swap(self, &mut other);
        self.parked = std::mem::take(&mut other.parked);
        self.parked.push(other);
    }

    /// Whether a tensor-parallel graph step of `rows` rows must run as a capture pass: unpipelined,
    /// so that no GPU wait for the host's CPU experts is pending while it captures (see
    /// [`GraphSet::may_capture`]; one GPU captures a pipelined step's segments before its layers
    /// run instead). One unpipelined step per batch size costs a few milliseconds once.
    pub fn capture_pass(&self, rows: usize) -> bool {
        !self.broken && !self.ready_rows.contains(&rows)
    }

    /// Whether a segment missing from the set may be captured now: only when no hand-off wait is
    /// pending (`waiting`). A pipelined step enqueues a layer's segment while the GPU spins on the
    /// previous layer's hand-off flag, and capturing and instantiating a graph then can block in the
    /// driver until the device idles, which it cannot do before the host raises that flag: on the
    /// H200 a 48-layer model's first decode step of each batch size stalled for the hand-off's whole
    /// 20 s deadline and failed. A missing segment found while a wait is pending runs eagerly, and
    /// its row count gets a capture pass (tensor parallelism) or a capture before the next step's
    /// layers (one GPU).
    pub fn may_capture(&mut self, rows: usize, waiting: bool) -> bool {
        if waiting {
            self.ready_rows.remove(&rows);
        }
        !waiting
    }

    /// Whether a step of `rows` rows with `mark` was walked and found every segment captured.
    pub fn walked(&self, rows: usize, mark: &WalkMark) -> bool {
        !self.broken && self.walked.get(&rows) == Some(mark)
    }

    /// A step of `rows` rows with `mark` walked every layer and found or captured each segment.
    pub fn mark_walked(&mut self, rows: usize, mark: WalkMark) {
        if !self.broken {
            self.walked.insert(rows, mark);
        }
    }
}

impl Default for GraphSet {
    /// An empty set of the fused segment kernels (their switch's default).
    fn default() -> Self {
        GraphSet {
            map: HashMap::new(),
            steps: HashMap::new(),
            halves: HashMap::new(),
            broken: false,
            ready_rows: HashSet::new(),
            walked: HashMap::new(),
            kernels: SegmentKernels::DEFAULT,
            parked: Vec::new(),
        }
    }
}

/// Whether a step whose layers are MoE or dense as `moe` says, with `routes`, stays on the device from
/// its first layer to its last: every MoE layer computes its experts in its segment from the device
/// routing ([`LayerRoute::Device`], every expert resident) and there is at least one. Such a step's
/// layer stack is one graph.
pub fn stays_on_device(moe: impl IntoIterator<Item = bool>, routes: &[LayerRoute]) -> bool {
    let mut any = false;
    for (is_moe, route) in moe.into_iter().zip(routes) {
        if is_moe {
            if *route != LayerRoute::Device {
                return false;
            }
            any = true;
        }
    }
    any
}

impl GpuModel {
    /// The expert placement's version: changes whenever a GPU expert is admitted or evicted (live
    /// re-placement), so whatever was derived from the residency (segment keys) can be checked.
    pub(super) fn placement_version(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| match &l.ffn {
                GpuFfn::Moe(m) => m.experts.version(),
                GpuFfn::Dense(_) => 0,
            })
            .sum()
    }

    /// Whether a step with `routes` stays on the device from its first layer to its last
    /// ([`stays_on_device`]).
    pub(super) fn stays_on_device(&self, routes: &[LayerRoute]) -> bool {
        let moe = self.layers.iter().map(|l| matches!(l.ffn, GpuFfn::Moe(_)));
        stays_on_device(moe, routes)
    }

    /// Replays the layer stack of a `rows`-row step that stays on the device, capturing `layers`
    /// (which enqueues every layer) the first time; eager when a capture fails (graphs are then off
    /// for the engine, as for segments).
    pub(super) fn replay_whole_step(
        &self,
        set: &mut GraphSet,
        rows: usize,
        layers: &mut dyn FnMut() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        if !set.broken && !set.steps.contains_key(&rows) {
            match self.dev.capture(&mut *layers)? {
                (Ok(()), Ok(Some(g))) => {
                    set.steps.insert(rows, g);
                }
                (r, g) => {
                    tracing::warn!(
                        "CUDA graph capture of a whole {rows}-row step failed ({:?}, {:?}); decode runs without graphs",
                        r.err(),
                        g.err()
                    );
                    set.broken = true;
                }
            }
        }
        match set.steps.get(&rows) {
            Some(g) if !set.broken => Ok(g.replay()?),
            _ => layers(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayerRoute::*;

    #[test]
    fn a_row_count_pipelines_only_after_a_capture_pass_with_nothing_pending() {
        let mut set = GraphSet::default();
        assert!(set.capture_pass(1), "nothing captured yet");
        // the capture pass waits for nothing: it may capture, and its row count becomes ready
        assert!(set.may_capture(1, false));
        set.ready_rows.insert(1);
        assert!(!set.capture_pass(1));
        assert!(set.capture_pass(8), "each row count has its own pass");
        // a pipelined step meeting a missing segment while a hand-off wait is pending: no capture,
        // and the next step of that row count is a capture pass again
        assert!(!set.may_capture(1, true));
        assert!(set.capture_pass(1));
        // broken graphs never need a pass (decode runs eagerly)
        set.broken = true;
        assert!(!set.capture_pass(1));
    }

    #[test]
    fn a_walked_mark_holds_only_for_the_same_rows_routes_and_placement() {
        let mut set = GraphSet::default();
        let mark = WalkMark {
            routes: vec![Host, Device],
            placement: 3,
        };
        assert!(!set.walked(1, &mark), "nothing walked yet");
        set.mark_walked(1, mark.clone());
        assert!(set.walked(1, &mark));
        assert!(!set.walked(8, &mark), "another row count");
        let moved = WalkMark {
            placement: 4,
            ..mark.clone()
        };
        assert!(!set.walked(1, &moved), "an expert moved since");
        let rerouted = WalkMark {
            routes: vec![Host, DeviceAndCpu],
            ..mark.clone()
        };
        assert!(!set.walked(1, &rerouted), "a layer's route changed");
        // the newest walk replaces the mark of its row count
        set.mark_walked(1, moved.clone());
        assert!(set.walked(1, &moved) && !set.walked(1, &mark));
        // broken graphs: nothing is walked any more (and nothing is skipped as walked)
        set.broken = true;
        assert!(!set.walked(1, &moved));
    }

    #[test]
    fn each_segment_kernel_keeps_its_graphs() {
        let (old, fused, folded) = (
            SegmentKernels::of(false, true, true),
            SegmentKernels::of(true, false, false),
            SegmentKernels::DEFAULT,
        );
        assert_eq!(
            old,
            SegmentKernels::of(false, false, false),
            "folding and the o GEMV need fused"
        );
        let mut set = GraphSet::default();
        set.ready_rows.insert(1);
        set.select_kernels(folded); // already the default kernels: nothing moves
        assert!(set.ready_rows.contains(&1));
        set.select_kernels(old);
        assert!(
            set.ready_rows.is_empty(),
            "the old kernels start without graphs"
        );
        set.ready_rows.insert(8);
        set.select_kernels(fused);
        assert!(set.ready_rows.is_empty());
        set.ready_rows.insert(2);
        set.select_kernels(folded);
        assert!(set.ready_rows.contains(&1) && !set.ready_rows.contains(&8));
        set.select_kernels(old);
        assert!(set.ready_rows.contains(&8) && !set.ready_rows.contains(&1));
        set.select_kernels(fused);
        assert!(set.ready_rows.contains(&2) && set.ready_rows.len() == 1);
        assert_eq!(set.parked.len(), 2);
    }

    #[test]
    fn only_steps_of_device_routed_moe_layers_stay_on_the_device() {
        // a dense first layer, then MoE layers
        let moe = [false, true, true];
        assert!(stays_on_device(moe, &[Host, Device, Device]));
        assert!(!stays_on_device(moe, &[Host, Device, DeviceAndCpu]));
        assert!(!stays_on_device(moe, &[Host, Host, Device]));
        // no MoE layer (a dense model): nothing is device-routed, the per-layer path runs
        assert!(!stays_on_device([false, false], &[Host, Host]));
    }
}
