//! Which (layer, expert) lives on the GPU and which in DRAM (the GPU memory plan that bounds it is the
//! shared sizing crate's, see `engine/gpu/memory.rs`).
//!
//! Strategies (as KTransformers): `uniform` — the same N experts' slots on every MoE layer, the lowest ids;
//! `frequency` — per layer, the N most-routed experts from a routing-statistics file written by
//! `--record-routing`; `front-loading` — the same total budget (N × layers) spent on the earliest layers
//! first; `random` — N per layer drawn with a fixed seed.
use rand::{seq::SliceRandom, SeedableRng};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementStrategy {
    Uniform,
    Frequency,
    FrontLoading,
    Random,
}

impl std::str::FromStr for PlacementStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uniform" => Ok(Self::Uniform),
            "frequency" => Ok(Self::Frequency),
            "front-loading" => Ok(Self::FrontLoading),
            "random" => Ok(Self::Random),
            _ => Err(format!(
                "unknown placement `{s}`: uniform, frequency, front-loading or random"
            )),
        }
    }
}

/// How many experts per MoE layer go to the GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GpuExperts {
    Count(usize),
    Ratio(f64),
    /// As many as fit in GPU memory after weights, KV cache and workspace.
    Auto,
}

impl std::str::FromStr for GpuExperts {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Self::Auto);
        }
        s.parse::<usize>()
            .map(Self::Count)
            .map_err(|_| format!("--gpu-experts takes a number or `auto`, got `{s}`"))
    }
}

/// Routing statistics: per MoE layer index, how often each expert was chosen.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoutingStats {
    pub counts: BTreeMap<usize, Vec<u64>>,
}

impl RoutingStats {
    pub fn record(&mut self, layer: usize, experts: usize, ids: &[u32]) {
        let c = self.counts.entry(layer).or_insert_with(|| vec![0; experts]);
        for &i in ids {
            if let Some(x) = c.get_mut(i as usize) {
                *x += 1;
            }
        }
    }
}

/// `placement[layer][expert]` = true when the expert lives on the GPU. Non-MoE layers get empty rows.
///
/// `pins` (from placement rules) fix some experts' homes: `Some(true)` on the GPU whatever the count,
/// `Some(false)` in DRAM; the strategy fills each layer up to `per_layer` GPU experts from the rest, in
/// its order of preference.
pub fn plan_placement(
    strategy: PlacementStrategy,
    moe_layers: &[bool],
    experts: usize,
    per_layer: usize,
    stats: Option<&RoutingStats>,
    seed: u64,
    pins: Option<&[Vec<Option<bool>>]>,
) -> Result<Vec<Vec<bool>>, String> {
    let per_layer = per_layer.min(experts);
    let n_moe = moe_layers.iter().filter(|&&m| m).count();
    let mut budget_left = per_layer * n_moe; // front-loading spends this from the first layer on
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(moe_layers.len());
    for (layer, &is_moe) in moe_layers.iter().enumerate() {
        if !is_moe {
            out.push(vec![]);
            continue;
        }
        let pin = |e: usize| {
            pins.and_then(|p| p.get(layer))
                .and_then(|r| r.get(e).copied().flatten())
        };
        let mut want = per_layer;
        // Experts in order of preference.
        let ranking: Vec<usize> = match strategy {
            PlacementStrategy::Uniform => (0..experts).collect(),
            PlacementStrategy::FrontLoading => {
                want = budget_left.min(experts);
                budget_left -= want;
                (0..experts).collect()
            }
            PlacementStrategy::Random => {
                let mut ids: Vec<usize> = (0..experts).collect();
                ids.shuffle(&mut rng);
                ids
            }
            PlacementStrategy::Frequency => {
                let stats = stats.ok_or("placement `frequency` needs --routing-stats FILE (written by --record-routing)")?;
                let counts = stats
                    .counts
                    .get(&layer)
                    .ok_or_else(|| format!("routing statistics have no entry for layer {layer}"))?;
                if counts.len() != experts {
                    return Err(format!(
                        "routing statistics for layer {layer} list {} experts, the model has {experts}",
                        counts.len()
                    ));
                }
                let mut ids: Vec<usize> = (0..experts).collect();
                ids.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
                ids
            }
        };
        let mut row: Vec<bool> = (0..experts).map(|e| pin(e) == Some(true)).collect();
        let mut placed = row.iter().filter(|&&g| g).count();
        for e in ranking {
            if placed >= want {
                break;
            }
            if pin(e).is_none() {
                row[e] = true;
                placed += 1;
            }
        }
        out.push(row);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(p: &[Vec<bool>]) -> Vec<usize> {
        p.iter().map(|r| r.iter().filter(|&&b| b).count()).collect()
    }

    #[test]
    fn uniform_and_front_loading_spend_the_same_budget() {
        let layers = [false, true, true, true];
        let u = plan_placement(PlacementStrategy::Uniform, &layers, 8, 3, None, 0, None).unwrap();
        assert_eq!(count(&u), vec![0, 3, 3, 3]);
        let f = plan_placement(
            PlacementStrategy::FrontLoading,
            &layers,
            8,
            3,
            None,
            0,
            None,
        )
        .unwrap();
        assert_eq!(count(&f), vec![0, 8, 1, 0]);
    }

    #[test]
    fn frequency_picks_hot_experts_and_needs_stats() {
        let layers = [true, true];
        let mut s = RoutingStats::default();
        s.record(0, 4, &[3, 3, 1, 2, 3, 1]);
        s.record(1, 4, &[0, 0, 2]);
        let p = plan_placement(
            PlacementStrategy::Frequency,
            &layers,
            4,
            2,
            Some(&s),
            0,
            None,
        )
        .unwrap();
        assert_eq!(p[0], vec![false, true, false, true]);
        assert_eq!(p[1], vec![true, false, true, false]);
        assert!(
            plan_placement(PlacementStrategy::Frequency, &layers, 4, 2, None, 0, None).is_err()
        );
    }

    #[test]
    fn random_is_seeded() {
        let layers = [true; 3];
        let a = plan_placement(PlacementStrategy::Random, &layers, 16, 5, None, 7, None).unwrap();
        let b = plan_placement(PlacementStrategy::Random, &layers, 16, 5, None, 7, None).unwrap();
        assert_eq!(a, b);
        assert_eq!(count(&a), vec![5, 5, 5]);
    }

    #[test]
    fn pins_come_first_and_the_strategy_fills_the_rest() {
        let layers = [true, true];
        let pins = vec![
            vec![Some(true), Some(false), None, None, Some(true)],
            vec![Some(false), Some(false), Some(false), None, None],
        ];
        let p = plan_placement(
            PlacementStrategy::Uniform,
            &layers,
            5,
            3,
            None,
            0,
            Some(&pins),
        )
        .unwrap();
        // layer 0: the two GPU pins plus the lowest free id (2); 1 is pinned to DRAM
        assert_eq!(p[0], vec![true, false, true, false, true]);
        // layer 1: only two experts are free, both go
        assert_eq!(p[1], vec![false, false, false, true, true]);
        // pins beyond the count are kept
        let p = plan_placement(
            PlacementStrategy::Uniform,
            &layers,
            5,
            1,
            None,
            0,
            Some(&pins),
        )
        .unwrap();
        assert_eq!(count(&p), vec![2, 1]);
    }

    #[test]
    fn gpu_experts_parse() {
        assert!("x".parse::<GpuExperts>().is_err());
        assert_eq!("auto".parse::<GpuExperts>(), Ok(GpuExperts::Auto));
        assert_eq!("12".parse::<GpuExperts>(), Ok(GpuExperts::Count(12)));
    }
}
