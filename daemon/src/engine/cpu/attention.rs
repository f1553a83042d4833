//! Attention over a batch of sequence chunks: projections run on all tokens of the batch at once; the
//! score/softmax/value part reads each token's own sequence cache with a causal limit at the token's
//! position and, for sliding-window layers, a lower limit, in one pass with an online softmax (GQA:
//! [`flash`], per token and KV head in tiles of a KV block; MLA: per token and head). Rows are written
//! to and read from the layer's KV storage through each sequence's block table (reserved by the
//! driver before the step). That work runs on the kernels' worker pool when the layer's projections
//! are packed on one: its workers spin for a while after each region, so rayon threads started right
//! after a projection would fight them for the same cores.
use super::flash;
use crate::engine::indexer::{self, Selection};
use crate::engine::kv::{slot, BlockId, LayerRows};
use crate::engine::linear::dot;
use crate::engine::ops::{rms_norm, rms_norm_rows};
use crate::engine::rope::Rope;
use crate::engine::Segment;
use crate::model::config::{LayerAttention, ModelConfig};
use crate::model::{GqaAttention, MlaAttention, MlaQuery, SparseAttention};
use moe_kernels::cpu::attention::OnlineSoftmax;

/// Per token: (segment index, absolute position).
fn token_positions(segments: &[Segment]) -> Vec<(usize, usize)> {
    segments
        .iter()
        .enumerate()
        .flat_map(|(s, seg)| (0..seg.len).map(move |i| (s, seg.pos0 + i)))
        .collect()
}

/// Stores each token's two rows (`a`, `b`: row-major, `width` wide, in step row order) at its position's
/// slot in its sequence's blocks.
fn write_rows(
    segments: &[Segment],
    tables: &[&[BlockId]],
    rows: &mut LayerRows,
    (a, aw): (&[f32], usize),
    (b, bw): (&[f32], usize),
) {
    for (seg, table) in segments.iter().zip(tables) {
        for i in 0..seg.len {
            let r = seg.row0 + i;
            rows.write(
                slot(table, seg.pos0 + i),
                &a[r * aw..(r + 1) * aw],
                &b[r * bw..(r + 1) * bw],
            );
        }
    }
}

/// `layout`: whether this layer rotates q/k (NoPE layers do not) and its sliding window.
#[allow(clippy::too_many_arguments)]
pub fn gqa_forward(
    attn: &GqaAttention,
    cfg: &ModelConfig,
    layout: LayerAttention,
    rope: &Rope,
    h: &[f32],
    segments: &[Segment],
    tables: &[&[BlockId]],
    rows: &mut LayerRows,
) -> Vec<f32> {
    let n = h.len() / cfg.hidden_size;
    let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let [mut q, mut k, v] = crate::engine::linear::forward_many([&attn.q, &attn.k, &attn.v], h, n);
    if let Some(w) = &attn.q_norm {
        rms_norm_rows(&mut q, w, cfg.rms_norm_eps);
    }
    if let Some(w) = &attn.k_norm {
        rms_norm_rows(&mut k, w, cfg.rms_norm_eps);
    }
    let tokens = token_positions(segments);
    let kw = nkv * hd;
    // Decode (one new token per sequence): rotation and KV append run in the attention region, per
    // token; a chunk of several tokens writes its rows first (each reads the ones before it).
    let decode = segments.iter().all(|s| s.len == 1);
    let queries = if decode && layout.rope {
        flash::Queries::Rotate(rope)
    } else {
        flash::Queries::Ready
    };
    if !decode {
        for (t, &(_, pos)) in tokens.iter().enumerate().filter(|_| layout.rope) {
            let (cos, sin) = rope.cos_sin(pos);
            rope.apply(&mut q[t * nh * hd..(t + 1) * nh * hd], hd, &cos, &sin);
            rope.apply(&mut k[t * kw..(t + 1) * kw], hd, &cos, &sin);
        }
        write_rows(segments, tables, rows, (&k, kw), (&v, kw));
    }
    let shape = flash::GqaShape {
        heads: nh,
        kv_heads: nkv,
        head_dim: hd,
        scale: cfg.attention_scale(),
    };
    let tokens_q: Vec<flash::TokenQuery> = tokens
        .iter()
        .enumerate()
        .map(|(t, &(s, pos))| flash::TokenQuery {
            q: &q[t * nh * hd..(t + 1) * nh * hd],
            positions: layout.first_attended(pos)..=pos,
            table: tables[s],
            new_kv: decode.then(|| (&k[t * kw..(t + 1) * kw], &v[t * kw..(t + 1) * kw])),
        })
        .collect();
    let out = flash::gqa_attend(shape, &tokens_q, queries, rows, attn.o.pool().map(|p| &**p));
    attn.o.forward(&out, n)
}

/// MLA over a step. `layout.rope` false: a NoPE layer (q and the shared key are not rotated). Layers with
/// a sparse-attention indexer attend only the positions it selects: an `Own` layer runs its indexer and
/// leaves the selection in `selection` for the `Shared` layers after it (same step, same tokens).
#[allow(clippy::too_many_arguments)]
pub fn mla_forward(
    attn: &MlaAttention,
    cfg: &ModelConfig,
    layout: LayerAttention,
    rope: &Rope,
    h: &[f32],
    segments: &[Segment],
    tables: &[&[BlockId]],
    rows: &mut LayerRows,
    selection: &mut Option<Selection>,
) -> Vec<f32> {
    let m = cfg.mla.as_ref().expect("MLA layer without MLA config");
    let n = h.len() / cfg.hidden_size;
    let nh = cfg.num_heads;
    let (nope, rd, vd, lora) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let qk = nope + rd;
    let (mut q, q_resid) = match &attn.q {
        MlaQuery::Direct(l) => (l.forward(h, n), None),
        MlaQuery::LowRank { a, norm, b } => {
            let r = rms_norm(&a.forward(h, n), norm, m.latent_norm_eps);
            (b.forward(&r, n), Some(r))
        }
    };
    let ckv = attn.kv_a.forward(h, n);
    let tokens = token_positions(segments);
    let mut latent = vec![0f32; n * lora];
    let mut k_rot = vec![0f32; n * rd];
    for (t, &(_, pos)) in tokens.iter().enumerate() {
        let row = &ckv[t * (lora + rd)..(t + 1) * (lora + rd)];
        latent[t * lora..(t + 1) * lora].copy_from_slice(&row[..lora]);
        k_rot[t * rd..(t + 1) * rd].copy_from_slice(&row[lora..]);
        if !layout.rope {
            continue;
        }
        let (cos, sin) = rope.cos_sin(pos);
        rope.apply(&mut k_rot[t * rd..(t + 1) * rd], rd, &cos, &sin);
        for head in 0..nh {
            let qh = &mut q[(t * nh + head) * qk..(t * nh + head + 1) * qk];
            rope.apply(&mut qh[nope..], rd, &cos, &sin);
        }
    }
    rms_norm_rows(&mut latent, &attn.kv_a_norm, m.latent_norm_eps);
    write_rows(segments, tables, rows, (&latent, lora), (&k_rot, rd));
    match (&attn.indexer, &cfg.indexer, &q_resid) {
        (Some(SparseAttention::Own(w)), Some(ix), Some(r)) => {
            *selection = Some(indexer::select(w, ix, rope, h, r, segments, tables, rows));
        }
        (Some(SparseAttention::Own(_)), ..) => {
            unreachable!("an indexer is built only with its config and q-LoRA")
        }
        (Some(SparseAttention::Shared), ..) => debug_assert!(
            selection.is_some(),
            "a shared indexer layer with no earlier selection (the config requires one)"
        ),
        (None, ..) => *selection = None,
    }
    let dense = Selection::all(n);
    let attended = selection.as_ref().unwrap_or(&dense);
    let rows = &*rows;
    let scale = cfg.attention_scale();
    let kv_b = &attn.kv_b;
    let mut out = vec![0f32; n * nh * vd];
    flash::for_each_chunk(attn.o.pool().map(|p| &**p), &mut out, vd, &|idx, o| {
        let (t, head) = (idx / nh, idx % nh);
        let (s, pos) = tokens[t];
        let table = tables[s];
        let qh = &q[(t * nh + head) * qk..(t * nh + head + 1) * qk];
        // Absorb W_uk: q_lat[c] = Σ_d q_nope[d] · kv_b[head·(nope+v) + d][c]
        let wk = &kv_b[head * (nope + vd) * lora..];
        let mut q_lat = vec![0f32; lora];
        for d in 0..nope {
            let row = &wk[d * lora..(d + 1) * lora];
            for (x, w) in q_lat.iter_mut().zip(row) {
                *x += qh[d] * w;
            }
        }
        // One pass: each position's latent row is widened once and used for its score and value.
        let mut o_lat = vec![0f32; lora];
        let (mut lat, mut k_rot) = (vec![0f32; lora], vec![0f32; rd]);
        let mut softmax = OnlineSoftmax::default();
        for p in attended.positions(t, pos) {
            let sl = slot(table, p);
            rows.read_a(sl, 0, &mut lat);
            rows.read_b(sl, 0, &mut k_rot);
            let s = (dot(&q_lat, &lat) + dot(&qh[nope..], &k_rot)) * scale;
            let (c, w) = softmax.push(s);
            for (x, y) in o_lat.iter_mut().zip(&lat) {
                *x = *x * c + w * y;
            }
        }
        let inv = 1.0 / softmax.sum;
        o_lat.iter_mut().for_each(|x| *x *= inv);
        // W_uv: v[j] = kv_b[head·(nope+v) + nope + j] · o_lat
        for (j, x) in o.iter_mut().enumerate() {
            *x = dot(&wk[(nope + j) * lora..(nope + j + 1) * lora], &o_lat);
        }
    });
    attn.o.forward(&out, n)
}
