//! Constrained sampling: a request may restrict or bias which tokens it samples (JSON schema, tool-call
//! grammars, `logit_bias`). Before each sampled token the constraint edits a copy of the logits — banned
//! tokens to −∞, biases added — and the sampler draws from what is left; the constraint then advances
//! past the chosen token. Before the forward pass of a step in which a sequence samples, the scheduler
//! calls `prepare`, so a constraint can compute its next mask while the model runs.
use crate::engine::sampling::Sampler;

/// Restricts or biases which tokens a sequence may sample.
pub trait TokenConstraint: Send {
    /// The forward pass that produces this sequence's next logits is about to run: a constraint may
    /// start computing its next mask now, elsewhere, so that `apply` does not wait for it. Results
    /// must not depend on whether (or when) this is called.
    fn prepare(&mut self) {}
    /// Edits this step's logits (one per vocabulary id): tokens that may not come next become −∞,
    /// biased tokens move. Returns false when the constraint cannot go on (no token allowed, grammar
    /// error): the sequence then stops.
    fn apply(&mut self, logits: &mut [f32]) -> bool;
    /// The sequence sampled `id`.
    fn advance(&mut self, id: u32);
    /// Nothing more may follow: the sequence ends here.
    fn is_complete(&self) -> bool;
}

/// The next token of a sequence, sampled under its constraint (if any), which is advanced past it.
/// None: the constraint is complete or allows no token, so the sequence stops.
pub(super) fn sample_next(
    sampler: &mut Sampler,
    constraint: Option<&mut (dyn TokenConstraint + 'static)>,
    logits: &[f32],
    prompt: &[u32],
    generated: &[u32],
) -> Option<u32> {
    let Some(c) = constraint else {
        return Some(sampler.sample_parts(logits, prompt, generated));
    };
    if c.is_complete() {
        return None;
    }
    let mut l = logits.to_vec();
    if !c.apply(&mut l) {
        return None;
    }
    let best_allowed = argmax_finite(&l)?;
    let id = sampler.sample_parts(&l, prompt, generated);
    // A draw can only land on a banned (−∞) token through rounding at the tail of the distribution;
    // the most likely allowed token stands in then.
    let id = if l.get(id as usize).is_some_and(|v| v.is_finite()) {
        id
    } else {
        best_allowed
    };
    c.advance(id);
    Some(id)
}

/// The highest finite logit's id; None when every token is banned.
fn argmax_finite(l: &[f32]) -> Option<u32> {
    l.iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampling::SamplingParams;

    struct OnlyOdd;
    impl TokenConstraint for OnlyOdd {
        fn apply(&mut self, logits: &mut [f32]) -> bool {
            for (i, l) in logits.iter_mut().enumerate() {
                if i % 2 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
            true
        }
        fn advance(&mut self, _: u32) {}
        fn is_complete(&self) -> bool {
            false
        }
    }

    #[test]
    fn sampling_never_lands_on_a_banned_token() {
        let logits: Vec<f32> = (0..64)
            .map(|i| if i % 2 == 0 { 9.0 } else { 0.0 })
            .collect();
        let mut p = SamplingParams::greedy();
        p.temperature = 1.0;
        p.seed = Some(7);
        let mut s = Sampler::new(&p);
        for _ in 0..200 {
            let id = sample_next(&mut s, Some(&mut OnlyOdd), &logits, &[], &[]).unwrap();
            assert_eq!(id % 2, 1);
        }
    }
}
