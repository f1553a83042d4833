//! Runs with a probe on every GPU (`engine::parallel::probe`), and the sweep that compares a group of
//! ranks with one GPU over fixtures, placements and group sizes, which the MLA and hybrid tests share:
//! each passes what it compares per step and how many steps a fixture must keep compared.
use super::tp;
use crate::common::{fixtures_root as fixtures, oracle, oracle_feeds, step};
use moe_daemon::engine::parallel::probe::{ProbeRecord, StepProbe};
use moe_daemon::engine::parallel::CommKind;
use moe_daemon::engine::placement::PlacementStrategy;
use moe_daemon::engine::{Engine, EngineOptions};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// One step's logits and what every GPU's probe read in it.
pub(super) struct Probed {
    pub logits: Vec<f32>,
    pub records: Vec<ProbeRecord>,
}

/// Loads `dir` with `opts` and a probe on every GPU, and runs `feeds` (one step each) on one sequence.
pub(super) fn run_probed(dir: &Path, opts: &EngineOptions, feeds: &[Vec<u32>]) -> Vec<Probed> {
    let mut e = Engine::load(dir, opts).unwrap();
    let probe = Arc::new(StepProbe::default());
    e.set_step_probe(Some(probe.clone()));
    let mut cache = e.new_cache();
    feeds
        .iter()
        .map(|f| Probed {
            logits: step(&e, &mut cache, f),
            records: probe.take(),
        })
        .collect()
}

/// A group's probed run on the oracle's schedule beside one GPU's, for a sweep's comparison.
pub(super) struct GroupRun<'a> {
    /// Says fixture, communicator, group size and placement in every printed line.
    pub tag: &'a str,
    /// The fixture's checkpoint.
    pub dir: &'a Path,
    pub world: usize,
    pub one: &'a [Probed],
    pub group: &'a [Probed],
    /// The fixture's `oracle.json`.
    pub oracle: &'a Value,
}

/// Which runs a sweep makes, and how much of them must be compared.
pub(super) struct Sweep<'a> {
    pub fixtures: &'a [&'a str],
    /// Routed experts per layer on the GPUs (spread over the ranks); 0: all in DRAM.
    pub gpu_experts: [usize; 2],
    /// Whether `(fixture, gpu_experts, world)` runs (bigger groups load and compile everything once
    /// per rank, so they run on fewer cases).
    pub runs: fn(&str, usize, usize) -> bool,
    /// Each fixture must have at least one step in `least_compared_of` compared: a comparison stops
    /// at a router near-tie, a wrong kernel moves the routing everywhere.
    pub least_compared_of: usize,
}

/// Each of `sweep`'s fixtures on one GPU and over each of `worlds` ranks through `comm`, at each
/// placement, on the oracle's schedule: `compare` checks a group's run against one GPU's and returns
/// the steps it compared; asserts each fixture's share of compared steps.
pub(super) fn probed_groups_match_one_gpu(
    sweep: &Sweep,
    comm: CommKind,
    worlds: &[usize],
    compare: impl Fn(&GroupRun) -> usize,
) {
    for &name in sweep.fixtures {
        let o = oracle(name);
        let dir = fixtures().join(name).join("model_bf16");
        let feeds = oracle_feeds(&o);
        let (mut compared, mut total) = (0, 0);
        for n_gpu in sweep.gpu_experts {
            let base = crate::common::gpu::gpu(n_gpu, PlacementStrategy::Uniform);
            let one = run_probed(&dir, &base, &feeds);
            for &world in worlds.iter().filter(|&&w| (sweep.runs)(name, n_gpu, w)) {
                let group = run_probed(&dir, &tp(base.clone(), world, comm), &feeds);
                let tag = format!("{name} {comm:?} tp={world} gpu_experts={n_gpu}");
                compared += compare(&GroupRun {
                    tag: &tag,
                    dir: &dir,
                    world,
                    one: &one,
                    group: &group,
                    oracle: &o,
                });
                total += one.len();
            }
        }
        println!("{name}: {compared} of {total} steps compared");
        assert!(
            sweep.least_compared_of * compared >= total,
            "{name}: only {compared} of {total} steps routed as on one GPU"
        );
    }
}
