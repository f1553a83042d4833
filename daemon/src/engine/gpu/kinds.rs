//! The model's kinds (from `config.json`) as the CUDA op layer's typed kinds.
use crate::model::config::{Activation, MoeConfig, RopeStyle, RouterKind};
use moe_kernels::cuda::ops;

pub fn gate_activation(a: Activation) -> ops::GateActivation {
    match a {
        Activation::Silu => ops::GateActivation::Silu,
        Activation::GeluTanh => ops::GateActivation::GeluTanh,
        Activation::Relu => ops::GateActivation::Relu,
    }
}

pub fn rotary_style(s: RopeStyle) -> ops::RotaryStyle {
    match s {
        RopeStyle::Neox => ops::RotaryStyle::Neox,
        RopeStyle::Interleaved => ops::RotaryStyle::Interleaved,
    }
}

/// The router of an MoE layer; the routed scaling factor applies to sigmoid routers only (softmax
/// routers' weights are the probabilities).
pub fn router_kind(mc: &MoeConfig) -> ops::RouterKind {
    match mc.router {
        RouterKind::Softmax { renormalize } => ops::RouterKind::Softmax { renormalize },
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            renormalize,
        } => ops::RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            renormalize,
            scaling: mc.routed_scaling_factor,
        },
    }
}
