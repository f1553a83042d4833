//! Token sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence / frequency penalties,
//! and a seeded RNG (same seed and logits → same tokens).
//!
//! Order, as vLLM: penalties → temperature → top-k → top-p → min-p → draw. Temperature 0 is greedy.
//! Repetition penalty applies to prompt and generated tokens; presence and frequency penalties to
//! generated tokens only (OpenAI semantics).
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables.
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }

    /// Checks ranges; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }
}

/// Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by 1e-40 overflows
/// to ±inf, and inf - inf makes every probability NaN.
pub const GREEDY_BELOW_TEMPERATURE: f32 = 1e-5;

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            params: params.clone(),
            rng,
        }
    }

    /// Samples with penalties over `history`, all of it treated as generated text.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.sample_parts(logits, &[], history)
    }

    /// Samples given the prompt and the tokens generated so far.
    pub fn sample_parts(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> u32 {
        let p = &self.params;
        let mut l = logits.to_vec();
        apply_penalties(&mut l, p, prompt, generated);
        if p.temperature < GREEDY_BELOW_TEMPERATURE {
            return argmax(&l) as u32;
        }
        let mut cand = candidates(&l, p.temperature);
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, v)| (v - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        if !(total.is_finite() && total > 0.0) {
            // Only reachable with non-finite logits; the most likely candidate is the safe answer.
            return cand[0].0 as u32;
        }
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, &q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let cut = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|&&q| q >= cut).count().max(1);
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &q) in probs.iter().enumerate() {
            if r < q {
                return cand[i].0 as u32;
            }
            r -= q;
        }
        cand[probs.len() - 1].0 as u32
    }
}

/// Weights `e^(v − max)` below this are left out before sorting: each is under half an f32 ulp of the
/// total (≥ 1: the largest candidate's own weight), so it changes neither the sums nor the cut-offs, and
/// it is drawn only when rounding leaves the draw past every larger candidate (then the last kept one is
/// drawn instead). Sorting the whole vocabulary cost milliseconds per token at 49K–150K entries.
const NEGLIGIBLE_LOGIT_GAP: f32 = 25.0 * std::f32::consts::LN_2;

/// `(token, logit / temperature)`, largest first (ties: lower token first), without the negligible ones.
fn candidates(l: &[f32], temperature: f32) -> Vec<(usize, f32)> {
    let scaled = |v: f32| v / temperature;
    let max = l
        .iter()
        .map(|&v| scaled(v))
        .max_by(|a, b| a.total_cmp(b))
        .unwrap_or(0.0);
    let keep = |v: f32| !max.is_finite() || v >= max - NEGLIGIBLE_LOGIT_GAP;
    let mut cand: Vec<(usize, f32)> = l
        .iter()
        .enumerate()
        .map(|(i, &v)| (i, scaled(v)))
        .filter(|&(_, v)| keep(v))
        .collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    cand
}

fn apply_penalties(l: &mut [f32], p: &SamplingParams, prompt: &[u32], generated: &[u32]) {
    if p.repetition_penalty != 1.0 {
        for &t in prompt.iter().chain(generated) {
            if let Some(v) = l.get_mut(t as usize) {
                *v = if *v > 0.0 {
                    *v / p.repetition_penalty
                } else {
                    *v * p.repetition_penalty
                };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for &t in generated {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
}

/// Index of the largest value (first one on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// log(softmax(logits)), for logprobs.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits.iter().map(|&x| (x - m).exp()).sum::<f32>().ln() + m;
    logits.iter().map(|&x| x - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(&SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, 2.0], &[]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(&SamplingParams {
                seed: Some(seed),
                ..params()
            });
            (0..40).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [1.0, 5.0, 4.9, 0.0];
        for p in [
            SamplingParams {
                top_k: 1,
                seed: Some(1),
                ..params()
            },
            SamplingParams {
                top_p: 0.01,
                seed: Some(1),
                ..params()
            },
            SamplingParams {
                min_p: 0.99,
                seed: Some(1),
                ..params()
            },
        ] {
            let mut s = Sampler::new(&p);
            for _ in 0..20 {
                assert_eq!(s.sample(&logits, &[]), 1);
            }
        }
    }

    #[test]
    fn top_k_limits_support() {
        let logits = [3.0, 2.9, 2.8, -10.0, 2.7];
        let mut s = Sampler::new(&SamplingParams {
            top_k: 2,
            seed: Some(3),
            ..params()
        });
        let seen: std::collections::HashSet<u32> =
            (0..200).map(|_| s.sample(&logits, &[])).collect();
        assert_eq!(seen, [0, 1].into_iter().collect());
    }

    #[test]
    fn penalties_move_greedy_choice() {
        let logits = [2.0, 1.9, 0.0];
        let mut rep = Sampler::new(&SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::greedy()
        });
        assert_eq!(rep.sample(&logits, &[0]), 1);
        let mut pres = Sampler::new(&SamplingParams {
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        });
        assert_eq!(
            pres.sample_parts(&logits, &[0], &[]),
            0,
            "prompt tokens are not penalised"
        );
        assert_eq!(pres.sample_parts(&logits, &[], &[0]), 1);
        let mut freq = Sampler::new(&SamplingParams {
            frequency_penalty: 0.06,
            ..SamplingParams::greedy()
        });
        assert_eq!(freq.sample(&logits, &[0]), 0);
        assert_eq!(freq.sample(&logits, &[0, 0]), 1);
    }

    #[test]
    fn validation_names_the_parameter() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..params()
        };
        assert!(bad.validate().unwrap_err().contains("top_p"));
        assert!(params().validate().is_ok());
    }

    #[test]
    fn tiny_temperatures_are_greedy_not_nan() {
        // Large logits over a tiny temperature overflow to inf; the draw used to pick the least
        // likely token.
        let logits = [10.0, 30.0, -5.0, 29.0];
        for t in [1e-40, 1e-30, 1e-8, 1e-6] {
            let mut s = Sampler::new(&SamplingParams {
                temperature: t,
                seed: Some(9),
                ..params()
            });
            for _ in 0..20 {
                assert_eq!(s.sample(&logits, &[]), 1, "temperature {t}");
            }
        }
        // Small but above the greedy cut-off still samples.
        let mut s = Sampler::new(&SamplingParams {
            temperature: 1e-3,
            seed: Some(9),
            ..params()
        });
        assert_eq!(s.sample(&logits, &[]), 1);
    }

    /// The draw as it was before negligible candidates were left out: every token sorted.
    fn sample_sorting_everything(p: &SamplingParams, rng: &mut StdRng, l: &[f32]) -> u32 {
        let mut cand: Vec<(usize, f32)> = l
            .iter()
            .enumerate()
            .map(|(i, &v)| (i, v / p.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, v)| (v - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    acc += q;
                    acc >= p.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let cut = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|&&q| q >= cut).count().max(1);
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut r = rng.random::<f32>() * total;
        for (i, &q) in probs.iter().enumerate() {
            if r < q {
                return cand[i].0 as u32;
            }
            r -= q;
        }
        cand[probs.len() - 1].0 as u32
    }

    /// A 16384-token vocabulary with a few high logits and a long tail 12–43 below them:
    /// leaving out the negligible candidates draws the same tokens as sorting everything, seed for
    /// seed, under temperature, top-k, top-p and min-p.
    #[test]
    fn pruned_candidates_draw_what_sorting_everything_draws() {
        let mut x = 0x2545_F491u32;
        let logits: Vec<f32> = (0..16384)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let u = (x >> 8) as f32 / (1 << 24) as f32;
                if i % 331 == 0 {
                    12.0 + 6.0 * u
                } else {
                    -25.0 + 25.0 * u
                }
            })
            .collect();
        for (t, top_k, top_p, min_p) in [
            (1.0, 0, 1.0, 0.0),
            (0.7, 0, 0.9, 0.0),
            (1.3, 40, 1.0, 0.0),
            (1.0, 0, 1.0, 0.05),
            (2.0, 0, 0.95, 0.0),
        ] {
            let p = SamplingParams {
                temperature: t,
                top_k,
                top_p,
                min_p,
                seed: Some(11),
                ..params()
            };
            let mut s = Sampler::new(&p);
            let mut rng = StdRng::seed_from_u64(11);
            let got: Vec<u32> = (0..64).map(|_| s.sample(&logits, &[])).collect();
            let want: Vec<u32> = (0..64)
                .map(|_| sample_sorting_everything(&p, &mut rng, &logits))
                .collect();
            assert_eq!(
                got, want,
                "temperature {t} top_k {top_k} top_p {top_p} min_p {min_p}"
            );
            if t <= 1.0 {
                let n = candidates(&logits, t).len();
                assert!(
                    n < 2000,
                    "the tail is left out: {n} kept at temperature {t}"
                );
            }
        }
    }

    #[test]
    fn log_softmax_normalises() {
        let l = log_softmax(&[1.0, 2.0, 3.0]);
        let s: f32 = l.iter().map(|x| x.exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
    }
}
