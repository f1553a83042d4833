//! Elementwise and row-wise operations of the transformer blocks (f32).

/// In place RMSNorm of each `dim`-wide row: x · w / sqrt(mean(x²) + eps).
pub fn rms_norm_rows(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_mut(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}

/// RMSNorm into a new buffer.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm_rows(&mut y, weight, eps);
    y
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// In place softmax of one row.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// `a += b`
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower index (as torch.topk on CPU).
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}
