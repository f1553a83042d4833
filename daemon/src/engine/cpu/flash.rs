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
//!
//! Decode steps (one new token per sequence) rotate each token's query and key and append its K and V
//! rows inside the same region, in the item that reads the token's own position: the step's
//! per-sequence work of a layer between its q/k/v and o projections is one pool region, none of it
//! left to the calling thread alone while the other workers wait.
use crate::engine::kv::{slot, BlockId, LayerRows, RowBuf, BLOCK};
use crate::engine::rope::Rope;
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
    /// A decode token's own K and V rows (`kv_heads × head_dim` each, K not rotated yet): appended at
    /// the last position of `positions` before anything reads it. `None`: already in the cache.
    pub new_kv: Option<(&'a [f32], &'a [f32])>,
}

/// How [`gqa_attend`] treats the tokens' queries (and the keys of `new_kv`).
#[derive(Clone, Copy)]
pub enum Queries<'a> {
    /// Rotated already (or a NoPE layer).
    Ready,
    /// Rotated here at each token's position (the last of its `positions`), query and new key alike.
    Rotate(&'a Rope),
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
    /// Per worker: a decode token's rotated key row on its way into the cache.
    static KEY: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention output `[tokens, heads × head_dim]` for `tokens`, reading K (`a`) and V (`b`) rows of
/// `rows` (and first appending the tokens' `new_kv` rows). Work items run on `pool` when given, else
/// on rayon.
pub fn gqa_attend(
    shape: GqaShape,
    tokens: &[TokenQuery<'_>],
    queries: Queries<'_>,
    rows: &mut LayerRows,
    pool: Option<&WorkerPool>,
) -> Vec<f32> {
    let threads = pool.map_or_else(rayon::current_num_threads, WorkerPool::threads);
    attend_split(shape, tokens, queries, rows, pool, threads)
}

/// [`gqa_attend`] with the context split for `threads` workers.
fn attend_split(
    shape: GqaShape,
    tokens: &[TokenQuery<'_>],
    queries: Queries<'_>,
    rows: &mut LayerRows,
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
    // The appended rows' blocks exist before the items write into them.
    for tq in tokens.iter().filter(|tq| tq.new_kv.is_some()) {
        rows.reserve_slot(slot(tq.table, *tq.positions.end()));
    }
    let kv = SharedRows::of(rows);
    // Per item and query head: running max, running sum, accumulator.
    let width = heads * (hd + 2);
    let mut partial = vec![0f32; items.len() * width];
    for_each_chunk(pool, &mut partial, width, &|i, out| {
        let it = items[i];
        let tq = &tokens[it.t];
        let pos = *tq.positions.end();
        let rotation = match queries {
            Queries::Ready => None,
            Queries::Rotate(rope) => Some((rope, rope.cos_sin(pos))),
        };
        if let (Some((k, v)), true) = (tq.new_kv, it.hi == pos) {
            // SAFETY: the token's own slot, reserved above; only this item writes or reads it
            // (the token's other items end before `pos`, other sequences' tables do not hold it).
            unsafe { append(&kv, shape, slot(tq.table, pos), (k, v), rotation.as_ref()) };
        }
        attend_range(shape, tq, rotation.as_ref(), it.lo..=it.hi, &kv, out);
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

/// A rotation's table and its cos/sin at one position.
type Rotation<'a> = (&'a Rope, (Vec<f32>, Vec<f32>));

/// Writes a decode token's K (rotated by `rotation`) and V rows at `slot`.
///
/// # Safety
/// `slot` is reserved in `kv` and no other thread reads or writes it during the call.
unsafe fn append(
    kv: &SharedRows,
    shape: GqaShape,
    slot: usize,
    (k, v): (&[f32], &[f32]),
    rotation: Option<&Rotation<'_>>,
) {
    KEY.with(|key| {
        let mut key = key.borrow_mut();
        key.clear();
        key.extend_from_slice(k);
        if let Some((rope, (cos, sin))) = rotation {
            rope.apply(&mut key, shape.head_dim, cos, sin);
        }
        // SAFETY: (caller).
        unsafe {
            kv.k.write(slot * kv.width, &key);
            kv.v.write(slot * kv.width, v);
        }
    })
}

/// One item: the online softmax of every query head over `range`, written as `(max, sum, acc)` per
/// head into `out` (`heads × (head_dim + 2)`), one KV block's consecutive slots at a time, read in
/// place from the cache (`attend_tile`, once per KV head on the tile's rows). `rotation`: the
/// token's query is rotated here first.
fn attend_range(
    shape: GqaShape,
    tq: &TokenQuery<'_>,
    rotation: Option<&Rotation<'_>>,
    range: RangeInclusive<usize>,
    rows: &SharedRows,
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
        // The query rows (rotated) times the softmax scale (the kernel takes scaled queries).
        qs.clear();
        qs.extend_from_slice(tq.q);
        if let Some((rope, (cos, sin))) = rotation {
            rope.apply(&mut qs, hd, cos, sin);
        }
        qs.iter_mut().for_each(|x| *x *= shape.scale);
        // The tile from position p0 for `len` values from element `off` of each row: up to the end
        // of its block (consecutive slots) or of the range.
        let tile_at = |p0: usize, off: usize, len: usize| {
            let s0 = slot(tq.table, p0);
            let n = hi.min((p0 / BLOCK + 1) * BLOCK - 1) + 1 - p0;
            let (start, need) = (s0 * rows.width + off, (n - 1) * rows.width + len);
            // SAFETY: slots of positions before the token's own (or its own, appended by this
            // item before): no thread writes them during the region.
            let (k, v) = unsafe { (rows.k.rows(start, need), rows.v.rows(start, need)) };
            Tile {
                k,
                v,
                n,
                stride: rows.width,
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
                prefetch_tile(row, tile_at(p, 0, row));
            }
        }
        let mut i = 0;
        while let Some(p0) = start(i) {
            if let Some(p) = start(i + PREFETCH_TILES) {
                prefetch_tile(row, tile_at(p, 0, row));
            }
            for g in 0..shape.kv_heads {
                let q = &qs[g * group * hd..(g + 1) * group * hd];
                let state = &mut out[g * group * (hd + 2)..(g + 1) * group * (hd + 2)];
                attend_tile(q, hd, tile_at(p0, g * hd, hd), state);
            }
            i += 1;
        }
    });
}

/// A layer's K and V storage as the items of one region read it and append to it: pointers taken
/// once from `&mut LayerRows`, and no reference to the whole storage while the region runs (an item
/// writes its token's new slot while the others read theirs); each tile is a slice of its own rows.
struct SharedRows {
    k: RawRows,
    v: RawRows,
    /// Values per slot (K and V rows are equally wide in GQA).
    width: usize,
}

/// One row kind's storage: its first element and length (elements).
#[derive(Clone, Copy)]
enum RawRows {
    F32(*mut f32, usize),
    F16(*mut half::f16, usize),
    Bf16(*mut half::bf16, usize),
}

// SAFETY: the items of a region write disjoint slots and read only slots nobody writes (see the
// callers of `RawRows::write` and `RawRows::rows`); the storage outlives the region.
unsafe impl Send for SharedRows {}
unsafe impl Sync for SharedRows {}

impl SharedRows {
    fn of(rows: &mut LayerRows) -> SharedRows {
        debug_assert_eq!(
            rows.a_width, rows.b_width,
            "GQA keeps K and V rows equally wide"
        );
        SharedRows {
            k: RawRows::of(&mut rows.a),
            v: RawRows::of(&mut rows.b),
            width: rows.a_width,
        }
    }
}

impl RawRows {
    fn of(buf: &mut RowBuf) -> RawRows {
        match buf {
            RowBuf::F32(v) => RawRows::F32(v.as_mut_ptr(), v.len()),
            RowBuf::F16(v) => RawRows::F16(v.as_mut_ptr(), v.len()),
            RowBuf::Bf16(v) => RawRows::Bf16(v.as_mut_ptr(), v.len()),
        }
    }

    /// Elements `start .. start + len` as the attention kernel reads them.
    ///
    /// # Safety
    /// No thread writes those elements while the returned rows live.
    unsafe fn rows<'a>(self, start: usize, len: usize) -> KvRows<'a> {
        use std::slice::from_raw_parts;
        let check = |total: usize| assert!(start + len <= total, "KV rows out of bounds");
        // SAFETY: in bounds (checked); no writer (caller).
        unsafe {
            match self {
                RawRows::F32(p, n) => {
                    check(n);
                    KvRows::F32(from_raw_parts(p.add(start), len))
                }
                RawRows::F16(p, n) => {
                    check(n);
                    KvRows::F16(from_raw_parts(p.add(start), len).reinterpret_cast())
                }
                RawRows::Bf16(p, n) => {
                    check(n);
                    KvRows::Bf16(from_raw_parts(p.add(start), len).reinterpret_cast())
                }
            }
        }
    }

    /// Stores `src` at elements `at ..`, rounded to the element type (as `RowBuf::write`).
    ///
    /// # Safety
    /// No other thread reads or writes those elements during the call.
    unsafe fn write(self, at: usize, src: &[f32]) {
        use std::slice::from_raw_parts_mut;
        let check = |total: usize| assert!(at + src.len() <= total, "KV row out of bounds");
        // SAFETY: in bounds (checked); exclusive (caller).
        unsafe {
            match self {
                RawRows::F32(p, n) => {
                    check(n);
                    from_raw_parts_mut(p.add(at), src.len()).copy_from_slice(src)
                }
                RawRows::F16(p, n) => {
                    check(n);
                    from_raw_parts_mut(p.add(at), src.len()).convert_from_f32_slice(src)
                }
                RawRows::Bf16(p, n) => {
                    check(n);
                    from_raw_parts_mut(p.add(at), src.len()).convert_from_f32_slice(src)
                }
            }
        }
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
                    new_kv: None,
                })
                .collect();
            let hw = shape.heads * shape.head_dim;
            // All tokens in one call, then each alone (a long context then splits over items).
            for threads in [1, 16] {
                let got = attend_split(shape, &tokens, Queries::Ready, &mut rows, None, threads);
                for (t, tq) in tokens.iter().enumerate() {
                    let one = std::slice::from_ref(tq);
                    let alone = attend_split(shape, one, Queries::Ready, &mut rows, None, threads);
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

    /// A decode step's rotation and KV append inside the items (`Queries::Rotate`, `new_kv`) give what
    /// the serial path gives (rotate q and k, write the rows, then attend), bit for bit: the outputs
    /// and the cache's bytes. Sequences of different lengths with their own scattered blocks, one of
    /// them starting a new block, a sliding window, split contexts (16 threads) and none (1); f32 and
    /// f16 rows.
    #[test]
    fn decode_append_in_the_items_equals_the_serial_path() {
        use crate::model::config::{RopeConfig, RopeScaling, RopeStyle};
        let rope = Rope::new(&RopeConfig {
            theta: 10_000.0,
            rotary_dim: 32,
            scaling: RopeScaling::None,
            style: RopeStyle::Neox,
        });
        let shape = GqaShape {
            heads: 6,
            kv_heads: 2,
            head_dim: 32,
            scale: 0.2,
        };
        let (kw, hw) = (
            shape.kv_heads * shape.head_dim,
            shape.heads * shape.head_dim,
        );
        // (cached positions, first attended position): the new token goes at `len`.
        let seqs = [(95usize, 0usize), (16, 0), (300, 200), (7, 0)];
        let tables: Vec<Vec<BlockId>> = seqs
            .iter()
            .enumerate()
            .map(|(i, &(len, _))| {
                (0..(len + 1).div_ceil(BLOCK) as BlockId)
                    .map(|b| (4 * b + i as BlockId) * 3 % 97 + 100 * i as BlockId)
                    .collect()
            })
            .collect();
        for dtype in [KvDtype::F32, KvDtype::F16] {
            // The cache before the step: every sequence's cached positions.
            let cached = || {
                let mut rows = LayerRows {
                    a: RowBuf::new(dtype),
                    b: RowBuf::new(dtype),
                    a_width: kw,
                    b_width: kw,
                    ..Default::default()
                };
                for (i, &(len, _)) in seqs.iter().enumerate() {
                    for p in 0..len {
                        let seed = 1000 * i as u32 + p as u32;
                        let (k, v) = (values(kw, 3 * seed), values(kw, 3 * seed + 1));
                        rows.write(slot(&tables[i], p), &k, &v);
                    }
                }
                rows
            };
            let q: Vec<Vec<f32>> = (0..seqs.len()).map(|i| values(hw, 50 + i as u32)).collect();
            let k: Vec<Vec<f32>> = (0..seqs.len()).map(|i| values(kw, 60 + i as u32)).collect();
            let v: Vec<Vec<f32>> = (0..seqs.len()).map(|i| values(kw, 70 + i as u32)).collect();
            for threads in [1, 16] {
                // Serial: rotate, write, attend the rotated queries.
                let (mut serial, mut fused) = (cached(), cached());
                let mut rq = q.clone();
                for (i, &(len, _)) in seqs.iter().enumerate() {
                    let (cos, sin) = rope.cos_sin(len);
                    let mut kr = k[i].clone();
                    rope.apply(&mut rq[i], shape.head_dim, &cos, &sin);
                    rope.apply(&mut kr, shape.head_dim, &cos, &sin);
                    serial.write(slot(&tables[i], len), &kr, &v[i]);
                }
                let ready: Vec<TokenQuery> = (0..seqs.len())
                    .map(|i| TokenQuery {
                        q: &rq[i],
                        positions: seqs[i].1..=seqs[i].0,
                        table: &tables[i],
                        new_kv: None,
                    })
                    .collect();
                let want = attend_split(shape, &ready, Queries::Ready, &mut serial, None, threads);
                let decode: Vec<TokenQuery> = (0..seqs.len())
                    .map(|i| TokenQuery {
                        q: &q[i],
                        positions: seqs[i].1..=seqs[i].0,
                        table: &tables[i],
                        new_kv: Some((&k[i][..], &v[i][..])),
                    })
                    .collect();
                let rot = Queries::Rotate(&rope);
                let got = attend_split(shape, &decode, rot, &mut fused, None, threads);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{dtype:?} threads {threads}: outputs"
                );
                assert_eq!(serial.a.len(), fused.a.len());
                let (mut a, mut b) = (vec![0f32; serial.a.len()], vec![0f32; fused.a.len()]);
                serial.a.read(0, &mut a);
                fused.a.read(0, &mut b);
                assert_eq!(bits(&a), bits(&b), "{dtype:?} threads {threads}: K rows");
                serial.b.read(0, &mut a);
                fused.b.read(0, &mut b);
                assert_eq!(bits(&a), bits(&b), "{dtype:?} threads {threads}: V rows");
            }
        }
    }
}
