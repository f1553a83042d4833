//! `CpuExpertSet::forward`: routing, then the parallel regions on the worker pool, one method each (see
//! the module doc of `moe` for the split and why); `forward_timed` adds each region's time to a
//! [`RegionTimes`].

use std::cell::RefCell;

use super::act::{gated_row, ActBuf, ActKind};
use super::fused::{DecodePath, FusedState, FUSED_MAX_TOKENS};
use super::gemm::{act_kind, amx_supports, gemm};
use super::{CpuExpertSet, MoeError};
use crate::cpu::features::CpuTier;
use crate::cpu::pool::WorkerPool;

/// One expert that got tokens in this call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Active {
    /// Index into the set's slots.
    pub e: usize,
    pub group: usize,
    /// First routed row (into `tok`/`wt`/`h`).
    pub start: usize,
    pub m: usize,
    /// First row in the 16-row padded buffers (`ga`, `ha`).
    pub pstart: usize,
    pub amx: bool,
}

/// Per-call buffers, kept between calls so decode allocates nothing.
#[derive(Default)]
pub(super) struct Scratch {
    counts: Vec<u32>,
    pub tok: Vec<u32>,
    pub wt: Vec<f32>,
    pub seq: Vec<u32>,
    pub active: Vec<Active>,
    pub xa: ActBuf,
    ga: ActBuf,
    pub ha: ActBuf,
    pub h: Vec<f32>,
    pub partial: Vec<f32>,
    /// Per group: (active index, first tile / row, count).
    items: Vec<Vec<(u32, u32, u32)>>,
    /// The decode path's plan and flags.
    pub fused: FusedState,
    /// The decode path every set working in this scratch takes instead of its own
    /// ([`CpuExpertSet::set_shared_decode_path`]).
    pub path_override: Option<DecodePath>,
}

#[derive(Clone, Copy)]
pub(super) struct SyncPtr<T>(pub *mut T);
// SAFETY: used only for writes to disjoint ranges from pool threads while the owner is borrowed.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// A method (not field access) so closures capture the whole Sync wrapper.
    pub fn get(self) -> *mut T {
        self.0
    }
}

thread_local! {
    static TLS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn with_tls<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    TLS.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < n {
            b.resize(n, 0.0);
        }
        f(&mut b[..n])
    })
}

/// Items of a region spread round-robin over groups: group g gets global items g, g + groups, ….
fn round_robin(n: usize, groups: usize) -> Vec<usize> {
    (0..groups).map(|g| (n + groups - 1 - g) / groups).collect()
}

const ROW_CHUNK: usize = 8;

/// Where `forward` calls spent their time, region by region (seconds, summed over calls), for
/// [`CpuExpertSet::forward_timed`]. Regions C and E run only for int8 down activations and for
/// several NUMA groups.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct RegionTimes {
    /// Grouping the routed rows by expert (host, single thread).
    pub route_s: f64,
    /// (A) token activations converted once, gathered per AMX expert.
    pub convert_s: f64,
    /// (B) gate and up, activation, routing weight.
    pub gate_up_s: f64,
    /// (C) intermediate rows quantized to int8.
    pub down_act_s: f64,
    /// (D) down, added into the output.
    pub down_s: f64,
    /// Decode calls on the fused path: B, C and D in one region.
    pub fused_s: f64,
    /// (E) the NUMA groups' partial sums added.
    pub reduce_s: f64,
    /// Calls timed.
    pub calls: u64,
}

impl RegionTimes {
    /// Adds another's times and calls to these.
    pub fn add(&mut self, o: &RegionTimes) {
        self.route_s += o.route_s;
        self.convert_s += o.convert_s;
        self.gate_up_s += o.gate_up_s;
        self.down_act_s += o.down_act_s;
        self.down_s += o.down_s;
        self.fused_s += o.fused_s;
        self.reduce_s += o.reduce_s;
        self.calls += o.calls;
    }
}

/// Adds each region's time to a [`RegionTimes`] when one is given; reads no clock otherwise.
struct RegionClock<'a> {
    times: Option<&'a mut RegionTimes>,
    last: Option<std::time::Instant>,
}

impl<'a> RegionClock<'a> {
    fn new(times: Option<&'a mut RegionTimes>) -> Self {
        let last = times.as_ref().map(|_| std::time::Instant::now());
        Self { times, last }
    }

    /// The time since the previous lap goes to `field`.
    fn lap(&mut self, field: fn(&mut RegionTimes) -> &mut f64) {
        if let (Some(t), Some(last)) = (self.times.as_deref_mut(), self.last.as_mut()) {
            let now = std::time::Instant::now();
            *field(t) += (now - *last).as_secs_f64();
            *last = now;
        }
    }
}

/// What every region of one call reads.
pub(super) struct Call<'a> {
    pub pool: &'a WorkerPool,
    x: &'a [f32],
    /// Tokens of the call.
    pub t: usize,
    pub tier: CpuTier,
    pub groups: usize,
    /// Hidden and intermediate widths, and their padded K (the gate and down layouts').
    pub hd: usize,
    pub id: usize,
    pub hp: usize,
    pub ip: usize,
    /// Activation kinds of gate/up and of down.
    pub gkind: ActKind,
    pub dkind: ActKind,
    /// Some expert runs on AMX: work items keep even tile counts.
    any_amx: bool,
    /// How this call runs if it is decode-sized: the set's path, or its scratch's override.
    pub path: DecodePath,
}

impl CpuExpertSet {
    /// `out[t] += Σ_j w[t][j] · FFN_{ids[t][j]}(x[t])` over the ids this set holds.
    ///
    /// `x`: T × hidden; `topk_ids`, `topk_weights`: T × `top_k`; `out`: T × hidden. Safe to call from
    /// several threads (calls on one set serialize); `pool` must be the pool the set was built with (or
    /// one with the same groups).
    pub fn forward(
        &self,
        pool: &WorkerPool,
        x: &[f32],
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
    ) -> Result<(), MoeError> {
        self.forward_timed(pool, x, topk_ids, topk_weights, top_k, out, None)
    }

    /// [`CpuExpertSet::forward`], adding each region's time to `times` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_timed(
        &self,
        pool: &WorkerPool,
        x: &[f32],
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &mut [f32],
        times: Option<&mut RegionTimes>,
    ) -> Result<(), MoeError> {
        let t = self.check_call(pool, x, topk_ids, topk_weights, top_k, out)?;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        let mut clock = RegionClock::new(times);
        if let Some(t) = clock.times.as_deref_mut() {
            t.calls += 1;
        }
        let (rows, prows) = self.route(s, topk_ids, topk_weights, top_k, t);
        clock.lap(|t| &mut t.route_s);
        if rows == 0 {
            return Ok(());
        }
        let (tier, fmt) = (self.tier, self.cfg.format);
        let (hp, ip) = (self.gate_l.k_pad, self.down_l.k_pad);
        let c = Call {
            pool,
            x,
            t,
            tier,
            groups: self.groups,
            hd: self.cfg.hidden,
            id: self.cfg.inter,
            hp,
            ip,
            gkind: act_kind(tier, fmt, hp),
            dkind: act_kind(tier, fmt, ip),
            any_amx: s.active.iter().any(|a| a.amx),
            path: s.path_override.unwrap_or(self.decode_path),
        };
        self.convert(s, &c, prows);
        clock.lap(|t| &mut t.convert_s);
        if c.path.is_fused() && !c.any_amx && t <= FUSED_MAX_TOKENS {
            self.fused_region(s, &c, rows, out);
            clock.lap(|t| &mut t.fused_s);
            if c.groups > 1 {
                self.reduce_groups(s, &c, out);
                clock.lap(|t| &mut t.reduce_s);
            }
            return Ok(());
        }
        // bf16 / f32 down activations are elementwise: written straight from B (no region C).
        let fuse = !matches!(c.dkind, ActKind::I8 { .. });
        self.gate_up(s, &c, rows, prows, fuse);
        clock.lap(|t| &mut t.gate_up_s);
        if !fuse {
            self.down_activations(s, &c);
            clock.lap(|t| &mut t.down_act_s);
        }
        self.down(s, &c, out);
        clock.lap(|t| &mut t.down_s);
        if c.groups > 1 {
            self.reduce_groups(s, &c, out);
            clock.lap(|t| &mut t.reduce_s);
        }
        Ok(())
    }

    /// Checks the call's lengths and pool; returns the token count.
    fn check_call(
        &self,
        pool: &WorkerPool,
        x: &[f32],
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        out: &[f32],
    ) -> Result<usize, MoeError> {
        let hd = self.cfg.hidden;
        if !x.len().is_multiple_of(hd) {
            return Err(MoeError::Input {
                got: x.len(),
                hidden: hd,
            });
        }
        let t = x.len() / hd;
        for (what, got, want) in [
            ("topk_ids", topk_ids.len(), t * top_k),
            ("topk_weights", topk_weights.len(), t * top_k),
            ("out", out.len(), x.len()),
        ] {
            if got != want {
                return Err(MoeError::Len { what, got, want });
            }
        }
        if pool.groups() != self.groups {
            return Err(MoeError::Pool {
                pool: pool.groups(),
                set: self.groups,
            });
        }
        Ok(t)
    }

    /// Routing: the (token, weight) rows of the experts this set holds, grouped by expert (counting
    /// sort), and the active experts with their row ranges. Returns (rows, rows padded to 16 per
    /// expert).
    fn route(
        &self,
        s: &mut Scratch,
        topk_ids: &[u32],
        topk_weights: &[f32],
        top_k: usize,
        t: usize,
    ) -> (usize, usize) {
        let n = self.slots.len();
        s.counts.clear();
        s.counts.resize(n, 0);
        let lookup = |gid: u32| self.local.get(gid as usize).copied().flatten();
        for &gid in topk_ids {
            if let Some(l) = lookup(gid) {
                s.counts[l as usize] += 1;
            }
        }
        s.active.clear();
        let (mut start, mut pstart) = (0, 0);
        let use_amx = self.tier == CpuTier::Amx && amx_supports(self.cfg.format);
        for e in 0..n {
            let m = s.counts[e] as usize;
            if m > 0 {
                let amx = use_amx && m >= self.cfg.amx_min_tokens;
                s.active.push(Active {
                    e,
                    group: self.slots[e].group,
                    start,
                    m,
                    pstart,
                    amx,
                });
                s.counts[e] = start as u32; // becomes the fill cursor
                start += m;
                pstart += m.div_ceil(16) * 16;
            }
        }
        let (rows, prows) = (start, pstart);
        if rows == 0 {
            return (0, 0);
        }
        s.tok.resize(rows, 0);
        s.wt.resize(rows, 0.0);
        for (i, (&gid, &w)) in topk_ids.iter().zip(topk_weights).enumerate() {
            if let Some(l) = lookup(gid) {
                let c = &mut s.counts[l as usize];
                s.tok[*c as usize] = (i / top_k) as u32;
                s.wt[*c as usize] = w;
                *c += 1;
            }
        }
        if s.seq.len() < prows.max(t) {
            s.seq = (0..prows.max(t) as u32).collect();
        }
        (rows, prows)
    }

    /// (A) token activations, converted once; (A2) gathered into 16-row blocks per AMX expert.
    fn convert(&self, s: &mut Scratch, c: &Call<'_>, prows: usize) {
        let (t, hd, hp, groups, gkind, x) = (c.t, c.hd, c.hp, c.groups, c.gkind, c.x);
        s.xa.reserve(gkind, t, hp);
        let xw = s.xa.writer(gkind, hp);
        if t <= ROW_CHUNK {
            // Decode: a few µs of conversion, cheaper here than waking the pool for it.
            for r in 0..t {
                // SAFETY: single writer.
                unsafe { xw.write_row(r, &x[r * hd..(r + 1) * hd]) };
            }
        } else {
            let chunks = t.div_ceil(ROW_CHUNK);
            c.pool.run(&round_robin(chunks, groups), &|g, i, _| {
                let ch = i * groups + g;
                for r in ch * ROW_CHUNK..((ch + 1) * ROW_CHUNK).min(t) {
                    // SAFETY: row r is written by this item only.
                    unsafe { xw.write_row(r, &x[r * hd..(r + 1) * hd]) };
                }
            });
        }
        if c.any_amx {
            s.ga.reserve(gkind, prows, hp);
            let gw = s.ga.writer(gkind, hp);
            let xv = s.xa.view(gkind, hp, &s.seq);
            let amx_active: Vec<Active> = s.active.iter().copied().filter(|a| a.amx).collect();
            let tok = &s.tok;
            c.pool
                .run(&round_robin(amx_active.len(), groups), &|g, i, _| {
                    let a = amx_active[i * groups + g];
                    for r in 0..a.m {
                        // SAFETY: rows pstart.. belong to this expert only.
                        unsafe { gw.copy_row(a.pstart + r, &xv, tok[a.start + r] as usize) };
                    }
                });
        }
    }

    /// (B) gate and up per (expert, chunk of output tiles); act ⊙ up · routing weight → the down
    /// activations (`fuse`: bf16 / f32, written directly) or the f32 rows `h` region C quantizes.
    fn gate_up(&self, s: &mut Scratch, c: &Call<'_>, rows: usize, prows: usize, fuse: bool) {
        let (tier, id, hp, ip, gkind, dkind) = (c.tier, c.id, c.hp, c.ip, c.gkind, c.dkind);
        s.ha.reserve(dkind, prows, ip);
        let hw = s.ha.writer(dkind, ip);
        if !fuse {
            s.h.resize(rows * id, 0.0);
        }
        let hptr = SyncPtr(s.h.as_mut_ptr());
        plan_tiles(
            &mut s.items,
            &s.active,
            c.groups,
            c.pool,
            self.gate_l.n_tiles,
            c.any_amx,
        );
        let (act, tok, wt, seq, items) = (&s.active, &s.tok, &s.wt, &s.seq, &s.items);
        let (xa, ga) = (&s.xa, &s.ga);
        let (actf, limit) = (self.cfg.activation, self.cfg.swiglu_limit);
        let counts: Vec<usize> = items.iter().map(Vec::len).collect();
        c.pool.run(&counts, &|g, i, _| {
            let (ai, nt0, nts) = items[g][i];
            let (nt0, nts) = (nt0 as usize, nts as usize);
            let a = act[ai as usize];
            let [gate, up, _] = self.mats(a.e);
            let view = if a.amx {
                ga.view(gkind, hp, &seq[a.pstart..a.pstart + a.m])
            } else {
                xa.view(gkind, hp, &tok[a.start..a.start + a.m])
            };
            let ld = 16 * nts;
            with_tls(3 * a.m * ld, |buf| {
                let (gy, rest) = buf.split_at_mut(a.m * ld);
                let (uy, hy) = rest.split_at_mut(a.m * ld);
                gemm(tier, a.amx, &gate, nt0, nts, &view, gy, ld);
                gemm(tier, a.amx, &up, nt0, nts, &view, uy, ld);
                let cols = (id - nt0 * 16).min(ld);
                for r in 0..a.m {
                    let (g, u) = (&gy[r * ld..r * ld + cols], &uy[r * ld..r * ld + cols]);
                    if fuse {
                        let hr = &mut hy[..cols];
                        gated_row(actf, limit, g, u, wt[a.start + r], hr);
                        // SAFETY: these columns of padded row pstart + r belong to this item.
                        unsafe { hw.write_cols(a.pstart + r, nt0 * 16, hr, nt0 * 16 + cols == id) };
                    } else {
                        // SAFETY: row (start + r), columns nt0*16.. of h belong to this item.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                hptr.get().add((a.start + r) * id + nt0 * 16),
                                cols,
                            )
                        };
                        gated_row(actf, limit, g, u, wt[a.start + r], dst);
                    }
                }
            });
        });
    }

    /// (C) int8 kinds: intermediate rows → down activations (a per-row scale needs the whole row).
    fn down_activations(&self, s: &mut Scratch, c: &Call<'_>) {
        let (id, ip, dkind) = (c.id, c.ip, c.dkind);
        let hw = s.ha.writer(dkind, ip);
        plan_rows(&mut s.items, &s.active, c.groups);
        let (act, items, h) = (&s.active, &s.items, &s.h);
        let counts: Vec<usize> = items.iter().map(Vec::len).collect();
        c.pool.run(&counts, &|g, i, _| {
            let (ai, r0, nr) = items[g][i];
            let a = act[ai as usize];
            for r in r0 as usize..(r0 + nr) as usize {
                // SAFETY: padded row pstart + r belongs to this item.
                unsafe {
                    hw.write_row(a.pstart + r, &h[(a.start + r) * id..(a.start + r + 1) * id])
                };
            }
        });
    }

    /// (D) down, by chunks of output tiles over all experts of the group; adds into `out` (group 0)
    /// or the group's partial sums.
    fn down(&self, s: &mut Scratch, c: &Call<'_>, out: &mut [f32]) {
        let (t, hd, ip, groups, tier, dkind) = (c.t, c.hd, c.ip, c.groups, c.tier, c.dkind);
        if groups > 1 {
            s.partial.clear();
            s.partial.resize((groups - 1) * t * hd, 0.0);
        }
        let optr = SyncPtr(out.as_mut_ptr());
        let pptr = SyncPtr(s.partial.as_mut_ptr());
        let d_tiles = self.down_l.n_tiles;
        let (act, tok, seq, ha) = (&s.active, &s.tok, &s.seq, &s.ha);
        let max_m = act.iter().map(|a| a.m).max().unwrap_or(0);
        let per_group: Vec<Vec<Active>> = (0..groups)
            .map(|g| act.iter().copied().filter(|a| a.group == g).collect())
            .collect();
        let chunk: Vec<usize> = (0..groups)
            .map(|g| {
                // Every item does the same work (all the group's experts over `c` tiles). With few
                // tokens, small items (6 per thread: 2 tiles = 48 KiB streams per expert at
                // decode) keep the phase's tail short; with many, each item re-reads every
                // expert's activation block, so 2 per thread.
                let per_thread = if max_m >= 16 { 2 } else { 6 };
                let ch = d_tiles
                    .div_ceil(per_thread * c.pool.threads_in_group(g))
                    .max(1);
                if c.any_amx {
                    ch + ch % 2
                } else {
                    ch
                }
            })
            .collect();
        let counts: Vec<usize> = (0..groups)
            .map(|g| {
                if per_group[g].is_empty() {
                    0
                } else {
                    d_tiles.div_ceil(chunk[g])
                }
            })
            .collect();
        c.pool.run(&counts, &|g, i, _| {
            let nt0 = i * chunk[g];
            let nts = chunk[g].min(d_tiles - nt0);
            let ld = 16 * nts;
            let cols = (hd - nt0 * 16).min(ld);
            let dst = if g == 0 {
                optr.get()
            } else {
                pptr.get().wrapping_add((g - 1) * t * hd)
            };
            with_tls(max_m * ld, |y| {
                for a in &per_group[g] {
                    let [_, _, down] = self.mats(a.e);
                    let view = ha.view(dkind, ip, &seq[a.pstart..a.pstart + a.m]);
                    gemm(tier, a.amx, &down, nt0, nts, &view, y, ld);
                    for r in 0..a.m {
                        let tk = tok[a.start + r] as usize;
                        // SAFETY: columns nt0*16.. of every output row belong to this item.
                        let o = unsafe {
                            std::slice::from_raw_parts_mut(dst.add(tk * hd + nt0 * 16), cols)
                        };
                        for (col, v) in o.iter_mut().enumerate() {
                            *v += y[r * ld + col];
                        }
                    }
                }
            });
        });
    }

    /// (E) several NUMA groups: their partial sums added into `out`.
    fn reduce_groups(&self, s: &Scratch, c: &Call<'_>, out: &mut [f32]) {
        let (t, hd, groups) = (c.t, c.hd, c.groups);
        let optr = SyncPtr(out.as_mut_ptr());
        let partial = &s.partial;
        let chunks = t.div_ceil(ROW_CHUNK);
        c.pool.run(&round_robin(chunks, groups), &|g, i, _| {
            let ch = i * groups + g;
            for r in ch * ROW_CHUNK..((ch + 1) * ROW_CHUNK).min(t) {
                // SAFETY: output row r belongs to this item.
                let o = unsafe { std::slice::from_raw_parts_mut(optr.get().add(r * hd), hd) };
                for p in 0..groups - 1 {
                    for (v, q) in o
                        .iter_mut()
                        .zip(&partial[(p * t + r) * hd..(p * t + r + 1) * hd])
                    {
                        *v += q;
                    }
                }
            }
        });
    }
}

/// Region B items: each active expert's output tiles cut into chunks so that every group has ~16 items
/// per thread (one decode token: 8 experts × 48 tiles over 16 threads → 2 tiles, 256 KB of bf16 gate
/// and up, each; small items keep the tail of the phase short).
fn plan_tiles(
    items: &mut Vec<Vec<(u32, u32, u32)>>,
    act: &[Active],
    groups: usize,
    pool: &WorkerPool,
    n_tiles: usize,
    even: bool,
) {
    items.resize(groups, Vec::new());
    for (g, list) in items.iter_mut().enumerate() {
        list.clear();
        let mine: Vec<(usize, &Active)> = act
            .iter()
            .enumerate()
            .filter(|(_, a)| a.group == g)
            .collect();
        let total = mine.len() * n_tiles;
        let mut chunk = total
            .div_ceil(16 * pool.threads_in_group(g))
            .clamp(1, n_tiles);
        if even {
            chunk = (chunk + chunk % 2).min(n_tiles);
        }
        for (ai, _) in mine {
            let mut nt = 0;
            while nt < n_tiles {
                let c = chunk.min(n_tiles - nt);
                list.push((ai as u32, nt as u32, c as u32));
                nt += c;
            }
        }
    }
}

/// Region C items: each active expert's rows in chunks of `ROW_CHUNK`.
fn plan_rows(items: &mut Vec<Vec<(u32, u32, u32)>>, act: &[Active], groups: usize) {
    items.resize(groups, Vec::new());
    for list in items.iter_mut() {
        list.clear();
    }
    for (ai, a) in act.iter().enumerate() {
        let mut r = 0;
        while r < a.m {
            let c = ROW_CHUNK.min(a.m - r);
            items[a.group].push((ai as u32, r as u32, c as u32));
            r += c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::moe::{ExpertSetConfig, ExpertSource, SourceTensor, WeightFormat};

    /// The timed call computes exactly what `forward` does, counts its calls and charges only the
    /// regions that ran (one NUMA group: no reduction; bf16: no separate down-activation pass).
    #[test]
    fn timed_forward_matches_and_charges_the_regions_that_ran() {
        let pool = WorkerPool::new(&[vec![0, 0]], false, std::time::Duration::from_micros(100));
        let (h, i) = (64usize, 48usize);
        let mut seed = 17u32;
        let mut bits = |n: usize| -> Vec<u16> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    0x3c00 | ((seed >> 16) as u16 & 0x807f) // ±[0.0078, 0.0156) in bf16
                })
                .collect()
        };
        let w: Vec<[Vec<u16>; 3]> = (0..3)
            .map(|_| [bits(i * h), bits(i * h), bits(h * i)])
            .collect();
        let sources: Vec<ExpertSource> = w
            .iter()
            .map(|m| ExpertSource {
                gate: SourceTensor::Bf16(&m[0]),
                up: SourceTensor::Bf16(&m[1]),
                down: SourceTensor::Bf16(&m[2]),
            })
            .collect();
        let cfg = ExpertSetConfig::new(h, i, WeightFormat::Bf16);
        let set = CpuExpertSet::new(&cfg, &[0, 1, 2], &sources, &pool).unwrap();
        let x: Vec<f32> = (0..3 * h).map(|j| (j % 7) as f32 - 3.0).collect();
        let (ids, wts) = ([0u32, 2, 1, 2, 0, 1], [0.5f32, 0.5, 0.25, 0.75, 1.0, 0.0]);
        let mut plain = vec![0f32; 3 * h];
        set.forward(&pool, &x, &ids, &wts, 2, &mut plain).unwrap();
        let mut times = RegionTimes::default();
        let mut timed = vec![0f32; 3 * h];
        for _ in 0..2 {
            timed.fill(0.0);
            let r = set.forward_timed(&pool, &x, &ids, &wts, 2, &mut timed, Some(&mut times));
            r.unwrap();
        }
        assert_eq!(plain, timed);
        assert!(plain.iter().any(|&v| v != 0.0));
        assert_eq!(times.calls, 2);
        assert_eq!((times.down_act_s, times.reduce_s), (0.0, 0.0));
        let total = times.route_s + times.convert_s + times.gate_up_s + times.down_s;
        assert!(total > 0.0);
    }

    /// Two sets on one shared scratch, called in turn with calls of different sizes, give exactly
    /// what each gives on its own scratch.
    #[test]
    fn sets_sharing_a_scratch_compute_what_they_do_alone() {
        let pool = WorkerPool::new(&[vec![0, 0]], false, std::time::Duration::from_micros(100));
        let (h, i) = (64usize, 48usize);
        let mut seed = 5u32;
        let mut bits = |n: usize| -> Vec<u16> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    0x3c00 | ((seed >> 16) as u16 & 0x807f)
                })
                .collect()
        };
        let w: Vec<[Vec<u16>; 3]> = (0..4)
            .map(|_| [bits(i * h), bits(i * h), bits(h * i)])
            .collect();
        let sources = |r: std::ops::Range<usize>| -> Vec<ExpertSource<'_>> {
            w[r].iter()
                .map(|m| ExpertSource {
                    gate: SourceTensor::Bf16(&m[0]),
                    up: SourceTensor::Bf16(&m[1]),
                    down: SourceTensor::Bf16(&m[2]),
                })
                .collect()
        };
        let cfg = ExpertSetConfig::new(h, i, WeightFormat::Bf16);
        let set = |r: std::ops::Range<usize>| {
            let ids: Vec<u32> = (0..r.len() as u32).collect();
            CpuExpertSet::new(&cfg, &ids, &sources(r), &pool).unwrap()
        };
        let (alone_a, alone_b) = (set(0..2), set(2..4));
        let shared_a = set(0..2);
        let shared_b = set(2..4).with_scratch(shared_a.scratch());
        // token counts alternate so the shared buffers grow and shrink between the sets' calls
        for (call, t) in [5usize, 1, 17, 2, 33, 1].into_iter().enumerate() {
            let x: Vec<f32> = (0..t * h)
                .map(|j| ((j * 7 + call) % 11) as f32 - 5.0)
                .collect();
            let ids: Vec<u32> = (0..2 * t).map(|j| ((j + call) % 2) as u32).collect();
            let wts: Vec<f32> = (0..2 * t).map(|j| 0.25 + (j % 3) as f32 * 0.25).collect();
            let (a, b) = if call % 2 == 0 {
                (&alone_a, &shared_a)
            } else {
                (&alone_b, &shared_b)
            };
            let mut want = vec![0f32; t * h];
            a.forward(&pool, &x, &ids, &wts, 2, &mut want).unwrap();
            let mut got = vec![0f32; t * h];
            b.forward(&pool, &x, &ids, &wts, 2, &mut got).unwrap();
            assert_eq!(got, want, "call {call}, {t} tokens");
            assert!(want.iter().any(|&v| v != 0.0));
        }
    }
}
