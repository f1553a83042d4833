//! The CPU backend's step: embedding, then per layer attention (GQA / MLA / linear) and the FFN (dense
//! MLP or MoE block) over the flattened token rows of the batch, then the final norm and lm_head on the
//! rows whose logits are wanted.
use super::{attention, hyper, linear_attention};
use crate::engine::{kv, moe, Engine, Segment, SeqInput, StepTimes};
use crate::model::config::RouterInput;
use crate::model::{Attention, Ffn};
use std::borrow::Cow;

impl Engine {
    /// Starts reading the packed DRAM experts that `routing` chose (each once) into the CPU caches, in
    /// the background, while the caller runs attention.
    fn prefetch_experts(&self, block: &crate::model::MoeBlock, routing: &moe::Routing) {
        let (Some((p, budget)), Some(set)) = (&self.prefetch, &block.cpu_set) else {
            return;
        };
        let mut ids = routing.ids.clone();
        ids.sort_unstable();
        ids.dedup();
        let regions: Vec<&[u8]> = ids.iter().filter_map(|&e| set.packed_expert(e)).collect();
        p.start(&regions, *budget);
    }

    pub(in crate::engine) fn run_validated(
        &self,
        batch: &mut [SeqInput<'_>],
        all: bool,
    ) -> Vec<Vec<f32>> {
        let mut times = StepTimes::default();
        let m = &self.model;
        let cfg = &m.config;
        let hd = cfg.hidden_size;
        let act = moe::GatedAct::of(cfg);
        let mut segments = Vec::with_capacity(batch.len());
        let mut tokens = Vec::new();
        for s in batch.iter() {
            segments.push(Segment {
                row0: tokens.len(),
                len: s.tokens.len(),
                pos0: s.cache.len(),
            });
            tokens.extend_from_slice(s.tokens);
        }
        let n = tokens.len();
        // Embedding lookup: row_f32 widens the stored row.
        let mut x = vec![0f32; n * hd];
        for (t, &id) in tokens.iter().enumerate() {
            m.embed.row_f32(id as usize, &mut x[t * hd..(t + 1) * hd]);
        }
        let mut residual = hyper::Residual::new(x, hd, cfg.hyper, cfg.rms_norm_eps);
        let store = self
            .cpu_kv
            .as_ref()
            .expect("the CPU backend has a CPU KV store");
        let mut kv_rows = store.lock();
        // Per group of layers (see `kv::layout`), each entry's block table.
        let groups = self.kv_layout.groups().len();
        let mut tables: Vec<Vec<&[kv::BlockId]>> = vec![Vec::with_capacity(batch.len()); groups];
        // Linear-attention state per entry (every entry has one when the model has linear layers).
        let mut states: Vec<&mut kv::RecurrentState> = Vec::with_capacity(batch.len());
        for s in batch.iter_mut() {
            let (group_tables, state) = s.cache.parts_mut();
            for (g, t) in group_tables.into_iter().enumerate() {
                tables[g].push(t);
            }
            states.extend(state);
        }
        // The sparse-attention selection of the last layer that ran its own indexer.
        let mut selection = None;
        for (li, layer) in m.layers.iter().enumerate() {
            // Routing from the layer input (SmallThinker) is decided before attention runs.
            let early = match (&layer.ffn, &cfg.moe, residual.plain()) {
                (Ffn::Moe(block), Some(mc), Some(x))
                    if mc.router_input == RouterInput::LayerInput =>
                {
                    let routing = moe::route(block, mc, x, hd, self.cpu_pool.as_deref());
                    self.prefetch_experts(block, &routing);
                    Some(routing)
                }
                _ => None,
            };
            let t_attn = std::time::Instant::now();
            let (input, mix) = residual.block_input(layer.hyper.as_ref().map(|h| &h.attn), hd);
            let h = normed(input, &layer.attn_norm, cfg.rms_norm_eps);
            let rows = &mut kv_rows[self.kv_layout.slot_of(li)];
            let tables = &tables[self.kv_layout.group_of(li)];
            let layout = cfg.layer_attention[li];
            let a = match &layer.attn {
                Attention::Gqa(g) => {
                    attention::gqa_forward(g, cfg, layout, &self.rope, &h, &segments, tables, rows)
                }
                // Sparse-attention layers (GLM-5, GLM-5.3-Flash) run their indexer inside: an `Own`
                // layer leaves its selection here for the `Shared` layer after it.
                Attention::Mla(a) => attention::mla_forward(
                    a,
                    cfg,
                    layout,
                    &self.rope,
                    &h,
                    &segments,
                    tables,
                    rows,
                    &mut selection,
                ),
                Attention::Linear(la) => linear_attention::linear_attention_forward(
                    la,
                    cfg,
                    li,
                    &h,
                    &segments,
                    &mut states,
                ),
            };
            residual.add_block_output(mix, &a, hd);
            times.attention_s += t_attn.elapsed().as_secs_f64();
            let (input, mix) = residual.block_input(layer.hyper.as_ref().map(|h| &h.ffn), hd);
            let h = normed(input, &layer.ffn_norm, cfg.rms_norm_eps);
            let f = match (&layer.ffn, &cfg.moe) {
                (Ffn::Moe(block), Some(mc)) => {
                    let pool = self.cpu_pool.as_deref();
                    let t = std::time::Instant::now();
                    if let Some((p, _)) = &self.prefetch {
                        p.cancel(); // the kernels read the weights now
                    }
                    let routing = early.unwrap_or_else(|| moe::route(block, mc, &h, hd, pool));
                    times.expert_hits += routing.ids.len() as u64;
                    self.record(li, &routing.ids);
                    let out = moe::moe_forward(block, pool, act, &h, hd, &routing);
                    times.cpu_experts_s += t.elapsed().as_secs_f64();
                    out
                }
                (Ffn::Dense(mlp), _) => {
                    let t = std::time::Instant::now();
                    let out = moe::mlp_forward(mlp, act, &h, n);
                    times.dense_mlp_s += t.elapsed().as_secs_f64();
                    out
                }
                (Ffn::Moe(_), None) => unreachable!("MoE layer built without MoE config"),
            };
            residual.add_block_output(mix, &f, hd);
        }
        drop((tables, states, kv_rows));
        let x = residual.into_hidden(hd);
        for s in batch.iter_mut() {
            s.cache.advance(s.tokens.len());
        }
        // Only the rows whose logits are wanted go through the final norm and lm_head.
        let t_head = std::time::Instant::now();
        let rows: Vec<usize> = if all {
            (0..n).collect()
        } else {
            segments.iter().map(|s| s.row0 + s.len - 1).collect()
        };
        let mut sel = Vec::with_capacity(rows.len() * hd);
        for &r in &rows {
            sel.extend_from_slice(&x[r * hd..(r + 1) * hd]);
        }
        let sel = normed(sel.into(), &m.final_norm, cfg.rms_norm_eps);
        let logits = m.lm_head().forward_rows(&sel, rows.len());
        times.head_s = t_head.elapsed().as_secs_f64();
        *self.last_step.lock().unwrap_or_else(|e| e.into_inner()) = times;
        logits
    }
}

/// RMSNorm of the rows of `x` into an owned buffer (16 lanes on AVX-512: the block inputs of every
/// token of a prefill go through here twice per layer).
fn normed(x: Cow<'_, [f32]>, weight: &[f32], eps: f32) -> Vec<f32> {
    let mut h = x.into_owned();
    moe_kernels::cpu::rms_norm_rows(&mut h, weight, eps);
    h
}
