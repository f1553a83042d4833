//! Constrained sampling: a request may restrict which tokens it samples (JSON mode, forced tool calls);
//! the scheduler asks the constraint before accepting a sampled token.
use crate::engine::sampling::Sampler;

/// Restricts which tokens a sequence may sample, e.g. to keep output a valid JSON prefix.
pub trait TokenConstraint: Send {
    fn allows(&self, id: u32) -> bool;
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
    let id = constrained_sample(sampler, logits, prompt, generated, c)?;
    c.advance(id);
    Some(id)
}

/// Samples, refusing tokens the constraint does not allow (resampling without them); after a few
/// refusals, takes the most likely allowed token. None: no token is allowed.
fn constrained_sample(
    sampler: &mut Sampler,
    logits: &[f32],
    prompt: &[u32],
    generated: &[u32],
    c: &dyn TokenConstraint,
) -> Option<u32> {
    let mut l = logits.to_vec();
    for _ in 0..16 {
        let id = sampler.sample_parts(&l, prompt, generated);
        if c.allows(id) {
            return Some(id);
        }
        l[id as usize] = f32::NEG_INFINITY;
    }
    let mut order: Vec<usize> = (0..l.len()).filter(|&i| l[i].is_finite()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    order.into_iter().map(|i| i as u32).find(|&i| c.allows(i))
}
