//! Per-sequence state of linear-attention layers: a fixed-size replacement for their KV cache.
//!
//! Each linear layer keeps, per sequence, the `heads × head_dim × head_dim` delta-rule state and the
//! last `kernel - 1` inputs of its short convolution. The size does not grow with the context, so it
//! lives outside the KV block pool, owned by the sequence's [`super::SeqCache`]: dropping the cache
//! (finish, preemption) drops the state, and a preempted sequence recomputes it from its tokens like its
//! KV rows.
//!
//! What a recurrent state cannot do is go back: it summarises every position written, so a prefix of
//! it cannot be recovered. Prefix reuse is therefore off for models with linear layers (the scheduler
//! asks [`super::SeqCache::supports_prefix_reuse`]); truncating such a cache starts it over.
//!
//! On the CUDA backend the state lives in GPU memory instead ([`RecurrentState::on_device`]): one
//! buffer per sequence holding every linear layer's part, created zeroed by the sequence's first step
//! and zeroed again whenever the sequence starts over (a step at position 0); dropping the cache frees it.
//! A tensor-parallel group keeps one such buffer per GPU, each holding the state of that GPU's heads.
use crate::model::hybrid::{LinearAttentionConfig, Mixer};
use cudarc::driver::CudaSlice;

/// One linear layer's state for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearLayerState {
    /// The last `kernel - 1` convolution inputs (q, k, v channels), oldest first:
    /// `[kernel - 1, 3 · qkv_dim]`. Zeros before the first token.
    pub conv: Vec<f32>,
    /// Delta-rule state per head, `[heads, head_dim (key), head_dim (value)]`.
    pub matrix: Vec<f32>,
}

/// One sequence's states, indexed by layer (None for attention layers).
#[derive(Debug)]
pub struct RecurrentState {
    layers: Vec<Option<LinearLayerState>>,
    /// The CUDA backend's copy of every linear layer's state (`engine::gpu::hybrid` lays it out), one
    /// per GPU of the group (rank 0 first; each its heads' part); empty on the CPU backend, None before
    /// the sequence's first GPU step.
    device: Vec<Option<CudaSlice<f32>>>,
}

impl Clone for RecurrentState {
    /// Copies the state (on the GPU too; a device copy that fails leaves the clone without one, and
    /// its next step fails with a clear error instead of continuing from a zero state).
    fn clone(&self) -> Self {
        Self {
            layers: self.layers.clone(),
            device: self
                .device
                .iter()
                .map(|d| d.as_ref().and_then(|d| d.try_clone().ok()))
                .collect(),
        }
    }
}

impl RecurrentState {
    /// Zero state for a model whose layers are `mixers`.
    pub fn new(mixers: &[Mixer], la: &LinearAttentionConfig) -> Self {
        let layers = mixers
            .iter()
            .map(|m| {
                (*m == Mixer::Linear).then(|| LinearLayerState {
                    conv: vec![0.0; (la.conv_kernel - 1) * 3 * la.qkv_dim()],
                    matrix: vec![0.0; la.num_heads * la.head_dim * la.head_dim],
                })
            })
            .collect();
        Self {
            layers,
            device: Vec::new(),
        }
    }

    /// A state kept in GPU memory by the CUDA backend (no host copy) for a model of `num_layers` layers
    /// run on `gpus` GPUs (a tensor-parallel group: one buffer on each).
    pub fn on_device(num_layers: usize, gpus: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| None).collect(),
            device: (0..gpus.max(1)).map(|_| None).collect(),
        }
    }

    /// The GPU buffer slots (CUDA backend), one per GPU of the group, rank 0 first.
    pub fn device_slots(&mut self) -> &mut [Option<CudaSlice<f32>>] {
        &mut self.device
    }

    /// Layer `li`'s state (None: not a linear layer).
    pub fn layer_mut(&mut self, li: usize) -> Option<&mut LinearLayerState> {
        self.layers.get_mut(li).and_then(Option::as_mut)
    }

    /// Back to the state before the first token (a GPU copy is zeroed by the next step, which starts
    /// at position 0).
    pub fn reset(&mut self) {
        for l in self.layers.iter_mut().flatten() {
            l.conv.fill(0.0);
            l.matrix.fill(0.0);
        }
    }

    /// Bytes held (f32 values of every linear layer, in host or GPU memory).
    pub fn bytes(&self) -> usize {
        let host: usize = self
            .layers
            .iter()
            .flatten()
            .map(|l| (l.conv.len() + l.matrix.len()) * 4)
            .sum();
        let device: usize = self.device.iter().flatten().map(|d| d.len() * 4).sum();
        host + device
    }

    /// Number of layers this state was sized for.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sized_per_linear_layer_and_reset_to_zero() {
        let la = LinearAttentionConfig {
            num_heads: 2,
            head_dim: 4,
            conv_kernel: 3,
            lower_bound: Some(-5.0),
        };
        let mut s = RecurrentState::new(&[Mixer::Linear, Mixer::Attention, Mixer::Linear], &la);
        assert!(s.layer_mut(1).is_none());
        let l = s.layer_mut(2).unwrap();
        assert_eq!((l.conv.len(), l.matrix.len()), (2 * 3 * 8, 2 * 16));
        l.matrix[3] = 1.0;
        assert_eq!(s.bytes(), 2 * la.state_floats() * 4);
        s.reset();
        assert!(s.layer_mut(2).unwrap().matrix.iter().all(|&x| x == 0.0));
    }
}
