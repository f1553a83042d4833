//! A synthetic skewed router for benchmarks and tests of expert placement: a "hot" share of each
//! layer's experts takes a fixed share of the routing (by default ~20 % of the experts take ~80 % of
//! the hits), and the hot set moves to other experts at a given step (the traffic changes).
//! Deterministic: the choice is a hash of (seed, step, token, layer, slot).

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SkewedRouting {
    pub experts: usize,
    pub top_k: usize,
    /// Share of the experts that are hot (0.2).
    pub hot_share: f64,
    /// Share of the hits the hot experts take (0.8).
    pub hot_mass: f64,
    /// From this step on the hot set is another one (disjoint where the experts allow).
    pub shift_at: u64,
    pub seed: u64,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl SkewedRouting {
    pub fn hot_count(&self) -> usize {
        ((self.experts as f64 * self.hot_share).round() as usize).clamp(1, self.experts)
    }

    /// Whether expert `e` of `layer` is hot at `step`. Each layer's hot set is a rotation of the
    /// experts (so layers differ); the shift rotates by the hot count again.
    pub fn is_hot(&self, layer: usize, e: usize, step: u64) -> bool {
        let hot = self.hot_count();
        let phase = usize::from(step >= self.shift_at);
        let start = (layer * 7 + phase * hot) % self.experts;
        (e + self.experts - start) % self.experts < hot
    }

    /// The `top_k` distinct experts token `token` of `step` is routed to at `layer`.
    pub fn choose(&self, layer: usize, step: u64, token: usize, out: &mut [u32]) {
        let (n, hot) = (self.experts, self.hot_count());
        let phase = usize::from(step >= self.shift_at);
        let start = (layer * 7 + phase * hot) % n;
        let k = out.len().min(n);
        let mut h = mix(self.seed ^ mix(step ^ mix(token as u64 ^ mix(layer as u64))));
        let mut filled = 0;
        while filled < k {
            h = mix(h);
            let from_hot = (h >> 11) as f64 / (1u64 << 53) as f64 <= self.hot_mass;
            h = mix(h);
            let e = if from_hot || hot == n {
                (start + (h as usize % hot)) % n
            } else {
                (start + hot + (h as usize % (n - hot))) % n
            } as u32;
            if !out[..filled].contains(&e) {
                out[filled] = e;
                filled += 1;
            }
        }
    }

    /// Expected routing counts of the first phase (what a statistics file recorded before the shift
    /// would show), per MoE layer.
    pub fn first_phase_counts(
        &self,
        moe_layers: &[bool],
    ) -> crate::engine::placement::RoutingStats {
        let mut stats = crate::engine::placement::RoutingStats::default();
        for (layer, _) in moe_layers.iter().enumerate().filter(|(_, &m)| m) {
            let row = (0..self.experts)
                .map(|e| if self.is_hot(layer, e, 0) { 1000 } else { 1 })
                .collect();
            stats.counts.insert(layer, row);
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_fifth_takes_about_four_fifths_and_shifts() {
        let r = SkewedRouting {
            experts: 128,
            top_k: 8,
            hot_share: 0.2,
            hot_mass: 0.8,
            shift_at: 100,
            seed: 1,
        };
        for (step0, phase_step) in [(0u64, 0u64), (100, 100)] {
            let (mut hot, mut all) = (0, 0);
            let mut ids = [0u32; 8];
            for step in step0..step0 + 50 {
                for t in 0..16 {
                    r.choose(3, step, t, &mut ids);
                    let mut sorted = ids;
                    sorted.sort_unstable();
                    assert!(sorted.windows(2).all(|w| w[0] != w[1]), "distinct");
                    hot += ids
                        .iter()
                        .filter(|&&e| r.is_hot(3, e as usize, phase_step))
                        .count();
                    all += ids.len();
                }
            }
            let share = hot as f64 / all as f64;
            // distinct top-k lowers the hot share a little below 0.8 (26 hot experts, 8 picks)
            assert!((0.70..0.85).contains(&share), "share {share}");
        }
        let before: Vec<bool> = (0..128).map(|e| r.is_hot(3, e, 0)).collect();
        let after: Vec<bool> = (0..128).map(|e| r.is_hot(3, e, 100)).collect();
        assert_eq!(before.iter().filter(|&&h| h).count(), 26);
        assert!(
            before.iter().zip(&after).all(|(a, b)| !(a & b)),
            "disjoint hot sets"
        );
    }
}
