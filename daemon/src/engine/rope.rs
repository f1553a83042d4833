//! Rotary position embeddings: inverse frequencies for default / linear / llama3 / YaRN scaling, and the
//! NeoX (rotate_half) and interleaved (DeepSeek) rotations, applied to the first `rotary_dim` dims.
//! Mirrors transformers' `modeling_rope_utils.py` (f32 frequencies, cos/sin times the attention factor).
use crate::model::config::{yarn_get_mscale, RopeConfig, RopeScaling, RopeStyle};

pub struct Rope {
    /// cos then sin (`rotary_dim / 2` each) of positions `0 .. len / rotary_dim`, filled on first use:
    /// every layer of a step rotates the same positions, and recomputing them cost thousands of libm
    /// calls per token (a small model's prefill spent ~4% of its time there).
    table: std::sync::RwLock<Vec<f32>>,
    inv_freq: Vec<f32>,
    /// YaRN's cos/sin multiplier (1 otherwise).
    attention_factor: f32,
    style: RopeStyle,
    rotary_dim: usize,
}

impl Rope {
    pub fn new(cfg: &RopeConfig) -> Self {
        let dim = cfg.rotary_dim;
        let base = cfg.theta;
        // torch: base ** (arange(0, dim, 2).float() / dim), in f32
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| (base as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        let mut inv_freq: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let mut attention_factor = 1.0f32;
        match cfg.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                for f in inv_freq.iter_mut() {
                    *f /= factor as f32;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f as f64;
                    let scaled = if wavelen > low_wavelen {
                        *f as f64 / factor
                    } else {
                        *f as f64
                    };
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen; // (no NaN here)
                    *f = if medium {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        ((1.0 - smooth) * scaled / factor + smooth * scaled) as f32
                    } else {
                        scaled as f32
                    };
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor: af,
                truncate,
            } => {
                attention_factor = match (af, mscale, mscale_all_dim) {
                    (Some(a), _, _) => a as f32,
                    (None, Some(m), Some(md)) if m != 0.0 && md != 0.0 => {
                        (yarn_get_mscale(factor, m) / yarn_get_mscale(factor, md)) as f32
                    }
                    _ => yarn_get_mscale(factor, 1.0) as f32,
                };
                let correction_dim = |rot: f64| {
                    (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let ramp =
                        (((i as f32) - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let interp = 1.0 / (factor as f32 * pos_freqs[i]);
                    let extrap = 1.0 / pos_freqs[i];
                    *f = interp * (1.0 - extrapolation) + extrap * extrapolation;
                }
            }
        }
        Self {
            table: Default::default(),
            inv_freq,
            attention_factor,
            style: cfg.style,
            rotary_dim: dim,
        }
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// cos and sin (each `rotary_dim / 2`) for one position.
    pub fn cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let at = pos * 2 * half;
        {
            let t = self.table.read().unwrap_or_else(|e| e.into_inner());
            if let Some(row) = t.get(at..at + 2 * half) {
                return (row[..half].to_vec(), row[half..].to_vec());
            }
        }
        // Positions up to the next multiple of 1024 past `pos` (what the sequences reach anyway).
        let mut t = self.table.write().unwrap_or_else(|e| e.into_inner());
        let have = t.len() / (2 * half).max(1);
        for p in have..(pos / 1024 + 1) * 1024 {
            let (c, s) = self.compute_cos_sin(p);
            t.extend_from_slice(&c);
            t.extend_from_slice(&s);
        }
        let row = &t[at..at + 2 * half];
        (row[..half].to_vec(), row[half..].to_vec())
    }

    fn compute_cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let p = pos as f32;
        self.inv_freq
            .iter()
            .map(|f| {
                let a = p * f;
                (
                    a.cos() * self.attention_factor,
                    a.sin() * self.attention_factor,
                )
            })
            .unzip()
    }

    /// Rotates the first `rotary_dim` dims of every `head_dim`-wide head in `x` (one token).
    pub fn apply(&self, x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = self.rotary_dim / 2;
        let mut tmp = vec![0f32; self.rotary_dim];
        for head in x.chunks_mut(head_dim) {
            let r = &mut head[..self.rotary_dim];
            match self.style {
                RopeStyle::Neox => {
                    for i in 0..half {
                        let (a, b) = (r[i], r[i + half]);
                        tmp[i] = a * cos[i] - b * sin[i];
                        tmp[i + half] = b * cos[i] + a * sin[i];
                    }
                }
                // DeepSeek: pairs (x0,x1),(x2,x3)…; output de-interleaved (evens then odds), as
                // transformers' apply_rotary_pos_emb_interleave. q and k get the same permutation.
                RopeStyle::Interleaved => {
                    for i in 0..half {
                        let (a, b) = (r[2 * i], r[2 * i + 1]);
                        tmp[i] = a * cos[i] - b * sin[i];
                        tmp[i + half] = b * cos[i] + a * sin[i];
                    }
                }
            }
            r.copy_from_slice(&tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table gives the values computed directly, bit for bit, before and after it grows.
    #[test]
    fn table_matches_direct_computation() {
        let cfg = RopeConfig {
            theta: 100_000.0,
            rotary_dim: 64,
            scaling: RopeScaling::None,
            style: RopeStyle::Neox,
        };
        let rope = Rope::new(&cfg);
        for pos in [7usize, 0, 1023, 1024, 3000, 7, 2047] {
            let (c, s) = rope.cos_sin(pos);
            let (wc, ws) = rope.compute_cos_sin(pos);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                (bits(&c), bits(&s)),
                (bits(&wc), bits(&ws)),
                "position {pos}"
            );
        }
    }
}
