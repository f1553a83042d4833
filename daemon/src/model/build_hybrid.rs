//! Loading GLM-5.3-Flash's own tensors: linear-attention layers and hyper-connections. Names are the
//! checkpoint's (`q_conv1d`, `f_a_proj`, `A_log`, `hc_attn_fn` …); transformers' module names
//! (`conv1d`, `forget_gate.*`, `attn_hc.*`) are read as well, for checkpoints saved without the
//! conversion back.
use super::build::{BuildError, Loader};
use super::config::ModelConfig;
use super::hybrid::HyperConfig;
use super::{HyperConnection, LayerHyper, LinearAttention};

impl Loader<'_> {
    /// The first of `names` the checkpoint holds (errors name the first).
    fn either<'n>(&self, names: &[&'n str]) -> &'n str {
        names
            .iter()
            .copied()
            .find(|n| self.src.contains(n))
            .unwrap_or(names[0])
    }
}

pub(super) fn linear_attention(
    ld: &Loader,
    cfg: &ModelConfig,
    p: &str,
) -> Result<LinearAttention, BuildError> {
    let la = cfg.linear_attention.as_ref().ok_or_else(|| {
        BuildError::Unsupported("linear-attention layer without its config".into())
    })?;
    let (h, heads, hd, kernel) = (cfg.hidden_size, la.num_heads, la.head_dim, la.conv_kernel);
    let qkv = la.qkv_dim();
    let a = format!("{p}.self_attn");
    let fused = format!("{a}.conv1d.weight");
    let conv = if ld.src.contains(&fused) {
        ld.tensor(&fused, &[3 * qkv, 1, kernel])?.to_f32()
    } else {
        let mut c = Vec::with_capacity(3 * qkv * kernel);
        for part in ["q", "k", "v"] {
            c.extend(
                ld.tensor(&format!("{a}.{part}_conv1d.weight"), &[qkv, 1, kernel])?
                    .to_f32(),
            );
        }
        c
    };
    let gate = |own: &str, module: &str| {
        ld.either(&[&format!("{a}.{own}"), &format!("{a}.forget_gate.{module}")])
            .to_owned()
    };
    let f_a = gate("f_a_proj", "f_a_proj");
    let f_b = gate("f_b_proj", "f_b_proj");
    let dt_bias = gate("dt_bias", "dt_bias");
    let a_log = gate("A_log", "A_log");
    Ok(LinearAttention {
        q: ld.linear(&format!("{a}.q_proj"), qkv, h)?,
        k: ld.linear(&format!("{a}.k_proj"), qkv, h)?,
        v: ld.linear(&format!("{a}.v_proj"), qkv, h)?,
        conv,
        f_a: ld.linear(&f_a, hd, h)?,
        f_b: ld.linear(&f_b, qkv, hd)?,
        dt_bias: ld.vector(&dt_bias, qkv)?,
        a_log: ld.vector(&a_log, heads)?,
        b: ld.linear(&format!("{a}.b_proj"), heads, h)?,
        g_a: ld.linear(&format!("{a}.g_a_proj"), hd, h)?,
        g_b: ld.linear(&format!("{a}.g_b_proj"), qkv, hd)?,
        o_norm: ld.vector(&format!("{a}.o_norm.weight"), hd)?,
        o: ld.linear(&format!("{a}.o_proj"), h, qkv)?,
    })
}

fn hyper_connection(
    ld: &Loader,
    h: usize,
    hc: &HyperConfig,
    p: &str,
    which: &str,
) -> Result<HyperConnection, BuildError> {
    let m = hc.mult;
    let rows = (2 + m) * m;
    let name = |part: &str| {
        ld.either(&[
            &format!("{p}.hc_{which}_{part}"),
            &format!("{p}.{which}_hc.{part}"),
        ])
        .to_owned()
    };
    let scale = ld.vector(&name("scale"), 3)?;
    Ok(HyperConnection {
        proj: ld.tensor(&name("fn"), &[rows, m * h])?.to_f32(),
        base: ld.vector(&name("base"), rows)?,
        scale: [scale[0], scale[1], scale[2]],
    })
}

pub(super) fn layer_hyper(
    ld: &Loader,
    cfg: &ModelConfig,
    hc: &HyperConfig,
    p: &str,
) -> Result<LayerHyper, BuildError> {
    Ok(LayerHyper {
        attn: hyper_connection(ld, cfg.hidden_size, hc, p, "attn")?,
        ffn: hyper_connection(ld, cfg.hidden_size, hc, p, "ffn")?,
    })
}
