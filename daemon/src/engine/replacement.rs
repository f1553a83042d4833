//! Live re-placement: the GPU as a cache of the hot experts, re-chosen while serving.
//!
//! Every step's routing is counted per (layer, expert) with exponential decay whose half-life is counted
//! in tokens (so a window holds the same evidence at batch 1 and batch 64), and the counts describe the
//! recent traffic. After every step (`interval_steps`) the policy pairs, per layer, the hottest DRAM
//! expert with the coldest GPU expert while the first is clearly hotter (hysteresis and a noise test),
//! and the mover starts those swaps as a bytes-per-second PCIe budget and its copy slots allow: copy the
//! DRAM expert to the GPU on a side stream, and once the copy has landed, between two steps, point the
//! layer's table at it and recycle the evicted one's memory for the next copy.
//!
//! How fast it follows a shift of the hot set: an old hot expert's count halves every half-life while a
//! new one's grows, and a swap needs the new one to lead by the noise test; with the defaults
//! (128 tokens) that takes 2-4 half-lives, ~40 steps at batch 8. Then the copies: at most
//! `max_in_flight` per step and the byte budget (4 GiB/s: 9 MiB Qwen3-30B experts at ~14 per 30 ms
//! step), so re-placing 12 layers' hot fifth (~300 experts) takes another ~40 steps. The number of GPU experts per layer never changes, so the memory plan
//! holds; experts pinned by placement rules never move. DRAM keeps every expert (the copy is the
//! source of a later move back), so an eviction is free.
//!
//! This file is the policy and its bookkeeping, with no GPU in it (unit-tested); `gpu::moves` does the
//! copies and the swap.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Settings of live re-placement (`--live-placement` and its flags).
#[derive(Debug, Clone, PartialEq)]
pub struct LiveOptions {
    /// PCIe budget for expert copies, bytes per second (the copies share the link with the
    /// activations' hand-off and long prompts' expert stream).
    pub pcie_bytes_per_s: f64,
    /// Tokens (of all sequences together) after which a routing count has lost half its weight.
    pub half_life_tokens: f64,
    /// Steps between two re-plannings (planning costs a sort of each layer's experts: microseconds).
    pub interval_steps: u32,
    /// A DRAM expert replaces a GPU one only when its decayed count exceeds the other's by this
    /// factor (0.25: 25 % hotter), so experts of similar heat do not trade places back and forth.
    pub hysteresis: f64,
    /// Copies in flight at once (each needs one expert's GPU memory until its swap). A copy lands
    /// within the step after it starts, so this is also the most moves per step.
    pub max_in_flight: usize,
}

impl Default for LiveOptions {
    fn default() -> Self {
        Self {
            pcie_bytes_per_s: DEFAULT_PCIE_MIB_PER_S as f64 * (1 << 20) as f64,
            half_life_tokens: DEFAULT_HALF_LIFE_TOKENS as f64,
            interval_steps: 1,
            hysteresis: 0.25,
            max_in_flight: moe_sizing::plan::LIVE_MOVE_SLOTS as usize,
        }
    }
}

/// Default PCIe budget of the copies (MiB/s): under a tenth of an H200's ~50 GB/s link, a sixth of a
/// PCIe 4 x16 one, and still ~14 Qwen3-30B experts per 30 ms step.
pub const DEFAULT_PCIE_MIB_PER_S: u64 = 4096;
/// Default half-life of the routing counts, in tokens: at batch 8 and top-8 that is 16 steps, and a
/// window of ~1500 activations per layer, enough to tell a hot expert from a cold one.
pub const DEFAULT_HALF_LIFE_TOKENS: u64 = 128;

/// Decayed routing counts per (layer, expert) and decayed GPU hit counts per layer.
#[derive(Debug, Clone)]
pub struct RoutingWindow {
    /// `counts[layer][expert]`; empty rows for dense layers.
    pub counts: Vec<Vec<f32>>,
    /// Per layer: decayed (GPU-served, all) expert activations.
    hits: Vec<(f64, f64)>,
    top_k: usize,
    half_life_tokens: f64,
    /// Most activations recorded by one layer in the current step (its tokens × top-k).
    step_activations: usize,
}

impl RoutingWindow {
    pub fn new(moe_layers: &[bool], experts: usize, top_k: usize, half_life_tokens: f64) -> Self {
        Self {
            counts: moe_layers
                .iter()
                .map(|&m| if m { vec![0.0; experts] } else { Vec::new() })
                .collect(),
            hits: vec![(0.0, 0.0); moe_layers.len()],
            top_k: top_k.max(1),
            half_life_tokens: half_life_tokens.max(1.0),
            step_activations: 0,
        }
    }

    /// Counts one layer's routing of a step; `resident[e]`: expert `e` was on the GPU.
    pub fn record(&mut self, layer: usize, ids: &[u32], resident: &[bool]) {
        let Some(row) = self.counts.get_mut(layer) else {
            return;
        };
        self.step_activations = self.step_activations.max(ids.len());
        let mut gpu = 0u64;
        for &id in ids {
            if let Some(c) = row.get_mut(id as usize) {
                *c += 1.0;
                gpu += u64::from(resident.get(id as usize).copied().unwrap_or(false));
            }
        }
        let h = &mut self.hits[layer];
        h.0 += gpu as f64;
        h.1 += ids.len() as f64;
    }

    /// Ages every count by the tokens of the step just recorded.
    pub fn end_step(&mut self) {
        let tokens = self.step_activations.div_ceil(self.top_k);
        self.step_activations = 0;
        if tokens == 0 {
            return;
        }
        let d = 0.5f64.powf(tokens as f64 / self.half_life_tokens) as f32;
        for row in &mut self.counts {
            row.iter_mut().for_each(|c| *c *= d);
        }
        for h in &mut self.hits {
            h.0 *= d as f64;
            h.1 *= d as f64;
        }
    }

    /// Share of the layer's recent expert activations served by GPU experts (`None` before any).
    pub fn hit_ratio(&self, layer: usize) -> Option<f64> {
        let &(g, all) = self.hits.get(layer)?;
        (all > 0.0).then(|| g / all)
    }
}

/// One swap: expert `admit` of `layer` comes to the GPU, expert `evict` goes back to DRAM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Move {
    pub layer: usize,
    pub admit: usize,
    pub evict: usize,
    /// Decayed count of `admit` minus that of `evict`: what the swap is expected to win.
    pub gain: f32,
}

/// Standard deviations of counting noise a swap's gain must exceed (see [`plan_moves`]).
const NOISE_Z: f64 = 4.0;

/// Swaps that would raise the GPU hit ratio, best first. `resident[l][e]`: on the GPU now; `movable`:
/// not pinned by a rule and not in a move already.
pub fn plan_moves(
    window: &RoutingWindow,
    resident: &[Vec<bool>],
    movable: impl Fn(usize, usize) -> bool,
    hysteresis: f64,
) -> Vec<Move> {
    let mut moves = Vec::new();
    for (layer, counts) in window.counts.iter().enumerate() {
        let Some(res) = resident.get(layer) else {
            continue;
        };
        if counts.is_empty() || res.len() != counts.len() {
            continue;
        }
        let by_heat = |pick_resident: bool, hottest_first: bool| {
            let mut ids: Vec<usize> = (0..counts.len())
                .filter(|&e| res[e] == pick_resident && movable(layer, e))
                .collect();
            ids.sort_by(|&a, &b| {
                let o = counts[a].total_cmp(&counts[b]).then(a.cmp(&b));
                if hottest_first {
                    o.reverse()
                } else {
                    o
                }
            });
            ids
        };
        let admit = by_heat(false, true);
        let evict = by_heat(true, false);
        for (&a, &v) in admit.iter().zip(&evict) {
            let (ca, cv) = (counts[a] as f64, counts[v] as f64);
            // Clearly hotter: by the hysteresis factor, and by more than sampling noise (counts of
            // equally hot experts differ by about sqrt(count); NOISE_Z of those is no real drift).
            if ca <= cv * (1.0 + hysteresis) + 1.0 || ca - cv <= NOISE_Z * (ca + cv).sqrt() {
                break;
            }
            moves.push(Move {
                layer,
                admit: a,
                evict: v,
                gain: counts[a] - counts[v],
            });
        }
    }
    moves.sort_by(|a, b| b.gain.total_cmp(&a.gain));
    moves
}

/// A token bucket of bytes: refills at `rate` per second up to `capacity`.
#[derive(Debug, Clone)]
pub struct ByteBudget {
    rate: f64,
    capacity: f64,
    level: f64,
}

impl ByteBudget {
    /// `burst`: the most bytes spent at once (at least one move's worth, or nothing would ever fit).
    pub fn new(rate: f64, burst: f64) -> Self {
        Self {
            rate: rate.max(0.0),
            capacity: burst.max(0.0),
            level: 0.0,
        }
    }

    pub fn refill(&mut self, elapsed: Duration) {
        self.level = (self.level + self.rate * elapsed.as_secs_f64()).min(self.capacity);
    }

    pub fn try_spend(&mut self, bytes: f64) -> bool {
        if bytes <= self.level {
            self.level -= bytes;
            true
        } else {
            false
        }
    }
}

/// The policy's state between steps: counts, budget, moves in flight, and the figures `/metrics` reads.
pub struct LivePlacement {
    pub opts: LiveOptions,
    pub window: RoutingWindow,
    budget: ByteBudget,
    bytes_per_move: f64,
    /// Per layer and expert: pinned by a placement rule (never moved).
    pinned: Vec<Vec<bool>>,
    in_flight: Vec<Move>,
    steps_since_plan: u32,
    last_step_end: Option<Instant>,
    /// Completion times of recent moves (for moves per minute).
    recent: VecDeque<Instant>,
    pub moves_total: u64,
}

impl LivePlacement {
    /// `top_k`: experts per token; `bytes_per_move`: bytes one expert copy moves over PCIe.
    pub fn new(
        opts: LiveOptions,
        moe_layers: &[bool],
        (experts, top_k): (usize, usize),
        pinned: Vec<Vec<bool>>,
        bytes_per_move: usize,
    ) -> Self {
        let bytes = bytes_per_move.max(1) as f64;
        // Burst: as many moves as there are copy slots (at least one move, or none would ever fit).
        let burst = bytes * opts.max_in_flight.max(1) as f64;
        Self {
            window: RoutingWindow::new(moe_layers, experts, top_k, opts.half_life_tokens),
            budget: ByteBudget::new(opts.pcie_bytes_per_s, burst),
            bytes_per_move: bytes,
            pinned,
            in_flight: Vec::new(),
            steps_since_plan: 0,
            last_step_end: None,
            recent: VecDeque::new(),
            moves_total: 0,
            opts,
        }
    }

    fn is_pinned(&self, layer: usize, e: usize) -> bool {
        self.pinned
            .get(layer)
            .and_then(|r| r.get(e))
            .copied()
            .unwrap_or(false)
    }

    /// Called once per step after its routing was recorded: ages the counts and, every interval,
    /// returns the swaps to start now (as many as the budget and the in-flight cap allow).
    pub fn after_step(&mut self, now: Instant, resident: &[Vec<bool>]) -> Vec<Move> {
        self.window.end_step();
        if let Some(t) = self.last_step_end {
            self.budget.refill(now.saturating_duration_since(t));
        }
        self.last_step_end = Some(now);
        self.steps_since_plan += 1;
        if self.steps_since_plan < self.opts.interval_steps.max(1) {
            return Vec::new();
        }
        self.steps_since_plan = 0;
        let busy = |l: usize, e: usize, f: &[Move]| {
            f.iter()
                .any(|m| m.layer == l && (m.admit == e || m.evict == e))
        };
        let candidates = plan_moves(
            &self.window,
            resident,
            |l, e| !self.is_pinned(l, e) && !busy(l, e, &self.in_flight),
            self.opts.hysteresis,
        );
        let mut started = Vec::new();
        for m in candidates {
            if self.in_flight.len() >= self.opts.max_in_flight.max(1) {
                break;
            }
            if !self.budget.try_spend(self.bytes_per_move) {
                break;
            }
            self.in_flight.push(m);
            started.push(m);
        }
        started
    }

    /// A started move has been swapped in (or failed: `done = false` puts nothing back but frees
    /// its slot).
    pub fn finished(&mut self, m: &Move, done: bool, now: Instant) {
        self.in_flight.retain(|x| x != m);
        if done {
            self.moves_total += 1;
            self.recent.push_back(now);
        }
    }

    /// Moves completed in the minute before `now`.
    pub fn moves_last_minute(&mut self, now: Instant) -> usize {
        while self
            .recent
            .front()
            .is_some_and(|&t| now.saturating_duration_since(t) > Duration::from_secs(60))
        {
            self.recent.pop_front();
        }
        self.recent.len()
    }

    pub fn in_flight(&self) -> &[Move] {
        &self.in_flight
    }
}

#[cfg(test)]
mod tests;
