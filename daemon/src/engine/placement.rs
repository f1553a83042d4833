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
pub fn plan_placement(
    strategy: PlacementStrategy,
    moe_layers: &[bool],
    experts: usize,
    per_layer: usize,
    stats: Option<&RoutingStats>,
    seed: u64,
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
        let mut row = vec![false; experts];
        let chosen: Vec<usize> = match strategy {
            PlacementStrategy::Uniform => (0..per_layer).collect(),
            PlacementStrategy::FrontLoading => {
                let n = budget_left.min(experts);
                budget_left -= n;
                (0..n).collect()
            }
            PlacementStrategy::Random => {
                let mut ids: Vec<usize> = (0..experts).collect();
                ids.shuffle(&mut rng);
                ids.truncate(per_layer);
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
                ids.truncate(per_layer);
                ids
            }
        };
        for e in chosen {
            row[e] = true;
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
        let u = plan_placement(PlacementStrategy::Uniform, &layers, 8, 3, None, 0).unwrap();
        assert_eq!(count(&u), vec![0, 3, 3, 3]);
        let f = plan_placement(PlacementStrategy::FrontLoading, &layers, 8, 3, None, 0).unwrap();
        assert_eq!(count(&f), vec![0, 8, 1, 0]);
    }

    #[test]
    fn frequency_picks_hot_experts_and_needs_stats() {
        let layers = [true, true];
        let mut s = RoutingStats::default();
        s.record(0, 4, &[3, 3, 1, 2, 3, 1]);
        s.record(1, 4, &[0, 0, 2]);
        let p = plan_placement(PlacementStrategy::Frequency, &layers, 4, 2, Some(&s), 0).unwrap();
        assert_eq!(p[0], vec![false, true, false, true]);
        assert_eq!(p[1], vec![true, false, true, false]);
        assert!(plan_placement(PlacementStrategy::Frequency, &layers, 4, 2, None, 0).is_err());
    }

    #[test]
    fn random_is_seeded() {
        let layers = [true; 3];
        let a = plan_placement(PlacementStrategy::Random, &layers, 16, 5, None, 7).unwrap();
        let b = plan_placement(PlacementStrategy::Random, &layers, 16, 5, None, 7).unwrap();
        assert_eq!(a, b);
        assert_eq!(count(&a), vec![5, 5, 5]);
    }

    #[test]
    fn gpu_experts_parse() {
        assert!("x".parse::<GpuExperts>().is_err());
        assert_eq!("auto".parse::<GpuExperts>(), Ok(GpuExperts::Auto));
        assert_eq!("12".parse::<GpuExperts>(), Ok(GpuExperts::Count(12)));
    }
}
