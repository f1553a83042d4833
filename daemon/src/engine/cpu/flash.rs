//! The score/softmax/value core of GQA attention on the CPU, flash style: one pass over the attended
//! positions in tiles of one KV block, an online softmax (running max and sum per query head, the
//! accumulator rescaled when the max grows), no score rows. Each work item is one (token, range of
//! positions) for every KV head: the tile's K and V rows are read where the cache keeps them and
//! widened in registers once for every query head of a KV head's group (Qwen3-30B-A3B: 8 heads per
//! KV head; the kernels' `attend_tile`), so a step reads each cached row once per layer and copies
//! none. An item reads whole cached rows (all KV heads of a position side by side), so a tile is
//! one contiguous span per block that the caches stream in; items per (token, KV head) read a third
//! of each row of SmolLM2 (3 KV heads) apart from the rest, and a batch of 8 sequences waited on
//! those rows' misses. Long contexts are split over several items per token so a single decode
//! token still spreads over every worker; the partial (max, sum, accumulator) triples are merged
//! afterwards (flash-decoding).
use crate::engine::kv::{slot, BlockId, LayerRows, RowBuf, BLOCK};
use half::slice::HalfFloatSliceExt;
use moe_kernels::cpu::attention::{attend_tile, prefetch_tile, KvRows, OnlineSoftmax, Tile};
use moe_kernels::cpu::WorkerPool;
use std::cell::RefCell;
use std::ops::RangeInclusive;

/// Fewest positions worth a work item of their own: below this the merge and the dispatch cost more
/// than the parallelism gains. Small on purpose: a decode token is one item per range of positions,
/// and a 2-thread pool wants two of them at short contexts; merging a split costs one `exp` per
/// query head.
const MIN_SPLIT_POSITIONS: usize = 32;

/// How many tiles ahead of the one computed an item asks the caches for its K and V rows.
const PREFETCH_TILES: usize = 2;

/// Shape of one GQA layer's attention core.
#[derive(Clone, Copy, Debug)]
pub struct GqaShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// What one token attends: its query heads (`heads × head_dim`), the positions, and the block table
/// of its sequence.
pub struct TokenQuery<'a> {
    pub q: &'a [f32],
    pub positions: RangeInclusive<usize>,
    pub table: &'a [BlockId],
}

/// One work item: token `t`, every KV head, positions `lo..=hi`.
#[derive(Clone, Copy, Debug)]
struct Item {
    t: usize,
    lo: usize,
    hi: usize,
}

thread_local! {
    /// Per worker: the scaled query rows of the token an item attends for.
    static QUERY: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention output `[tokens, heads × head_dim]` for `tokens`, reading K (`a`) and V (`b`) rows of
/// `rows`. Work items run on `pool` when given, else on rayon.
pub fn gqa_attend(
    shape: GqaShape,
    tokens: &[TokenQuery<'_>],
    rows: &LayerRows,
    pool: Option<&WorkerPool>,
) -> Vec<f32> {
    let threads = pool.map_or_else(rayon::current_num_threads, WorkerPool::threads);
    attend_split(shape, tokens, rows, pool, threads)
}

/// [`gqa_attend`] with the context split for `threads` workers.
fn attend_split(
    shape: GqaShape,
    tokens: &[TokenQuery<'_>],
    rows: &LayerRows,
    pool: Option<&WorkerPool>,
    threads: usize,
) -> Vec<f32> {
    let GqaShape {
        heads,
        kv_heads,
        head_dim: hd,
        ..
    } = shape;
    debug_assert!(kv_heads > 0 && heads.is_multiple_of(kv_heads));
    // Splits per token: enough items for every thread, none shorter than the minimum.
    let max_splits = (2 * threads).div_ceil(tokens.len().max(1)).max(1);
    let mut items = Vec::new();
    for (t, tq) in tokens.iter().enumerate() {
        let (lo, hi) = (*tq.positions.start(), *tq.positions.end());
        let len = hi + 1 - lo;
        let mut splits = len.div_ceil(MIN_SPLIT_POSITIONS).clamp(1, max_splits);
        if splits > threads {
            splits -= splits % threads; // 3 equal items on 2 threads take as long as 4
        }
        // Split on block boundaries so every tile stays inside one block.
        let per = len.div_ceil(splits).div_ceil(BLOCK) * BLOCK;
        let mut a = lo;
        while a <= hi {
            let b = (a + per).min(hi + 1) - 1;
            items.push(Item { t, lo: a, hi: b });
            a = b + 1;
        }
    }
    // Per item and query head: running max, running sum, accumulator.
    let width = heads * (hd + 2);
    let mut partial = vec![0f32; items.len() * width];
    for_each_chunk(pool, &mut partial, width, &|i, out| {
        let it = items[i];
        attend_range(shape, &tokens[it.t], it.lo..=it.hi, rows, out);
    });
    // Merge the items of each token in order, head by head.
    let mut out = vec![0f32; tokens.len() * heads * hd];
    let mut first = 0;
    while first < items.len() {
        let t = items[first].t;
        let mut end = first + 1;
        while end < items.len() && items[end].t == t {
            end += 1;
        }
        for head in 0..heads {
            let o = &mut out[(t * heads + head) * hd..(t * heads + head + 1) * hd];
            let part = |i: usize| &partial[i * width + head * (hd + 2)..][..hd + 2];
            let mut softmax = OnlineSoftmax::default();
            for i in first..end {
                let p = part(i);
                let (c_o, c_p) = softmax.merge(OnlineSoftmax {
                    max: p[0],
                    sum: p[1],
                });
                for (x, y) in o.iter_mut().zip(&p[2..]) {
                    *x = *x * c_o + c_p * y;
                }
            }
            let inv = 1.0 / softmax.sum;
            o.iter_mut().for_each(|x| *x *= inv);
        }
        first = end;
    }
    out
}

/// One item: the online softmax of every query head over `range`, written as `(max, sum, acc)` per
/// head into `out` (`heads × (head_dim + 2)`), one KV block's consecutive slots at a time, read in
/// place from the cache (`attend_tile`, once per KV head on the tile's rows).
fn attend_range(
    shape: GqaShape,
    tq: &TokenQuery<'_>,
    range: RangeInclusive<usize>,
    rows: &LayerRows,
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let (lo, hi) = (*range.start(), *range.end());
    for o in out.chunks_exact_mut(hd + 2) {
        o[0] = f32::NEG_INFINITY;
        o[1] = 0.0;
        o[2..].fill(0.0);
    }
    QUERY.with(|qs| {
        let mut qs = qs.borrow_mut();
        // The query rows times the softmax scale (the kernel takes scaled queries).
        qs.clear();
        qs.extend(tq.q.iter().map(|x| x * shape.scale));
        let (k, v) = (kv_rows(&rows.a), kv_rows(&rows.b));
        debug_assert_eq!(
            rows.a_width, rows.b_width,
            "GQA keeps K and V rows equally wide"
        );
        // The tile from position p0 for the heads from element `off` of each row: up to the end of
        // its block (consecutive slots) or of the range.
        let tile_at = |p0: usize, off: usize| {
            let s0 = slot(tq.table, p0);
            Tile {
                k: k.from(s0 * rows.a_width + off),
                v: v.from(s0 * rows.b_width + off),
                n: hi.min((p0 / BLOCK + 1) * BLOCK - 1) + 1 - p0,
                stride: rows.a_width,
            }
        };
        // Tiles start at `lo` and then at each block boundary. The rows come from DRAM more often
        // than not (a step's weights stream through the caches between two reads of a layer's
        // cache), and one tile's work is shorter than a miss: the first tiles are requested before
        // any is computed, and each tile asks for the one `PREFETCH_TILES` ahead (whole rows: every
        // KV head's part of them is read).
        let start = |i: usize| {
            let p = if i == 0 { lo } else { (lo / BLOCK + i) * BLOCK };
            (p <= hi).then_some(p)
        };
        let row = shape.kv_heads * hd;
        for i in 0..PREFETCH_TILES {
            if let Some(p) = start(i) {
                prefetch_tile(row, tile_at(p, 0));
            }
        }
        let mut i = 0;
        while let Some(p0) = start(i) {
            if let Some(p) = start(i + PREFETCH_TILES) {
                prefetch_tile(row, tile_at(p, 0));
            }
            for g in 0..shape.kv_heads {
                let q = &qs[g * group * hd..(g + 1) * group * hd];
                let state = &mut out[g * group * (hd + 2)..(g + 1) * group * (hd + 2)];
                attend_tile(q, hd, tile_at(p0, g * hd), state);
            }
            i += 1;
        }
    });
}

/// A layer's K or V storage as the attention kernel reads it.
fn kv_rows(buf: &RowBuf) -> KvRows<'_> {
    match buf {
        RowBuf::F32(v) => KvRows::F32(v),
        RowBuf::F16(v) => KvRows::F16(v.reinterpret_cast()),
        RowBuf::Bf16(v) => KvRows::Bf16(v.reinterpret_cast()),
    }
}

/// Runs `f(idx, chunk)` for every `width`-wide chunk of `out` in parallel: on `pool` when there is one
/// (chunk `idx` to group `idx % groups`), else on rayon.
pub fn for_each_chunk(
    pool: Option<&WorkerPool>,
    out: &mut [f32],
    width: usize,
    f: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    use rayon::prelude::*;
    let Some(pool) = pool else {
        out.par_chunks_mut(width)
            .enumerate()
            .for_each(|(idx, o)| f(idx, o));
        return;
    };
    let n = out.len() / width;
    let groups = pool.groups();
    let per_group: Vec<usize> = (0..groups).map(|g| (n + groups - 1 - g) / groups).collect();
    let base = out.as_mut_ptr() as usize;
    pool.run(&per_group, &|g, i, _| {
        let idx = i * groups + g;
        // SAFETY: every idx < n is handed out exactly once, so the chunks are disjoint; `out` outlives
        // the region (`run` returns when every item is done).
        let chunk =
            unsafe { std::slice::from_raw_parts_mut((base as *mut f32).add(idx * width), width) };
        f(idx, chunk);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv::{KvDtype, RowBuf};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// The two-pass reference: full score row, softmax, weighted sum, in f64 over the f32 rows.
    fn reference(
        shape: GqaShape,
        q: &[f32],
        keys: &[Vec<f32>],
        vals: &[Vec<f32>],
        range: RangeInclusive<usize>,
    ) -> Vec<f32> {
        let hd = shape.head_dim;
        let group = shape.heads / shape.kv_heads;
        let mut out = vec![0f32; shape.heads * hd];
        for head in 0..shape.heads {
            let kh = (head / group) * hd;
            let qh = &q[head * hd..(head + 1) * hd];
            let s: Vec<f64> = range
                .clone()
                .map(|p| {
                    let k = &keys[p][kh..kh + hd];
                    qh.iter()
                        .zip(k)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * shape.scale as f64
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (w, p) in e.iter().zip(range.clone()) {
                for d in 0..hd {
                    out[head * hd + d] += (w / sum * vals[p][kh + d] as f64) as f32;
                }
            }
        }
        out
    }

    fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    }

    /// Against the two-pass f64 reference over the same positions: f32 rows to 1e-5 relative L2
    /// (rounding order only); f16 rows to 2e-3 and bf16 rows to 1e-2 (one rounding of K and V each, at
    /// 2⁻¹² / 2⁻⁹ relative per value). Covers a scattered block table, windows that start and end
    /// inside blocks, contexts split over several items (with a merge) and a single position.
    #[test]
    fn flash_matches_the_two_pass_reference() {
        let shape = GqaShape {
            heads: 8,
            kv_heads: 2,
            head_dim: 32,
            scale: 0.3,
        };
        let (kw, len) = (shape.kv_heads * shape.head_dim, 700usize);
        let keys: Vec<Vec<f32>> = (0..len).map(|p| values(kw, 3 * p as u32 + 1)).collect();
        let vals: Vec<Vec<f32>> = (0..len).map(|p| values(kw, 3 * p as u32 + 2)).collect();
        // Blocks in reverse order, every other one: slots are not positions.
        let table: Vec<BlockId> = (0..len.div_ceil(BLOCK) as BlockId)
            .rev()
            .map(|b| 2 * b + 1)
            .collect();
        for (dtype, tol) in [
            (KvDtype::F32, 1e-5),
            (KvDtype::F16, 2e-3),
            (KvDtype::Bf16, 1e-2),
        ] {
            let mut rows = LayerRows {
                a: RowBuf::new(dtype),
                b: RowBuf::new(dtype),
                a_width: kw,
                b_width: kw,
                ..Default::default()
            };
            for p in 0..len {
                rows.write(slot(&table, p), &keys[p], &vals[p]);
            }
            let ranges = [0..=699, 5..=37, 17..=17, 300..=650, 0..=0];
            let qs: Vec<Vec<f32>> = (0..ranges.len())
                .map(|i| values(shape.heads * shape.head_dim, 1000 + i as u32))
                .map(|q| q.iter().map(|x| x * 4.0).collect())
                .collect();
            let tokens: Vec<TokenQuery> = ranges
                .iter()
                .zip(&qs)
                .map(|(r, q)| TokenQuery {
                    q,
                    positions: r.clone(),
                    table: &table,
                })
                .collect();
            let hw = shape.heads * shape.head_dim;
            // All tokens in one call, then each alone (a long context then splits over items).
            for threads in [1, 16] {
                let got = attend_split(shape, &tokens, &rows, None, threads);
                for (t, tq) in tokens.iter().enumerate() {
                    let alone = attend_split(shape, std::slice::from_ref(tq), &rows, None, threads);
                    let want = reference(shape, tq.q, &keys, &vals, tq.positions.clone());
                    for got in [&got[t * hw..(t + 1) * hw], &alone[..]] {
                        let e = rel_l2(got, &want);
                        let r = &tq.positions;
                        assert!(e <= tol, "{dtype:?} threads {threads} range {r:?}: {e}");
                    }
                }
            }
        }
    }
}
