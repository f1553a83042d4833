//! How the layers' KV rows share one block pool when some layers attend over a sliding window.
//!
//! vLLM's hybrid allocator is the model: layers are split into groups of equal size, each group holding
//! layers of one kind (full attention, or one window size). Every group has its own block table per
//! sequence, and the storage has one row array per *slot*: the i-th layer of every group keeps its rows
//! in slot i, addressed by its own group's block ids. So a block is the same number of bytes whatever
//! group it serves, one pool and one budget cover all of them, and a sliding group can give back the
//! blocks that left its window (see `SeqCache::reserve`) for any group to reuse.
//!
//! SmallThinker-21B (13 full layers, 39 with a 4096 window): 4 groups of 13 layers. A 16K-token
//! sequence holds 1024 blocks in the full group and 256 in each sliding group between steps: 1792 blocks
//! of 13 layers instead of 1024 of 52, 44% of the rows.
//!
//! A model without windowed layers has one group of every layer (slot = layer): the single-table layout
//! every other architecture had before.
use super::blocks::{blocks_for, BLOCK};
use super::RowWidths;

/// One group: layers of the same attention kind, in slot order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroup {
    /// Sliding window of its layers (None: full attention, every block is kept).
    pub window: Option<usize>,
    pub layers: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    groups: Vec<KvGroup>,
    /// Per layer: (group, slot).
    place: Vec<(usize, usize)>,
    slots: usize,
}

impl KvLayout {
    /// Every layer in one group that keeps every block.
    pub fn single(num_layers: usize) -> Self {
        Self {
            groups: vec![KvGroup {
                window: None,
                layers: (0..num_layers).collect(),
            }],
            place: (0..num_layers).map(|l| (0, l)).collect(),
            slots: num_layers,
        }
    }

    /// Groups by window (`windows[l]`: layer l's sliding window, None for full attention). Falls back to
    /// [`Self::single`] when no layer has a window or when the layers' rows differ in width (slots are
    /// shared across groups, so their rows must be alike).
    pub fn grouped(windows: &[Option<usize>], widths: &[RowWidths]) -> Self {
        let n = windows.len();
        let alike = widths.windows(2).all(|w| w[0] == w[1]);
        if !alike || windows.iter().all(Option::is_none) {
            return Self::single(n);
        }
        // Kinds in order of first appearance, with their layers.
        let mut kinds: Vec<(Option<usize>, Vec<usize>)> = Vec::new();
        for (l, &w) in windows.iter().enumerate() {
            match kinds.iter_mut().find(|(k, _)| *k == w) {
                Some((_, ls)) => ls.push(l),
                None => kinds.push((w, vec![l])),
            }
        }
        // Group size: the largest that divides every kind's layer count (1 at worst: one layer each).
        let size = kinds.iter().fold(0, |g, (_, ls)| gcd(g, ls.len()));
        let mut groups = Vec::new();
        let mut place = vec![(0, 0); n];
        for (window, layers) in kinds {
            for chunk in layers.chunks(size) {
                for (slot, &l) in chunk.iter().enumerate() {
                    place[l] = (groups.len(), slot);
                }
                groups.push(KvGroup {
                    window,
                    layers: chunk.to_vec(),
                });
            }
        }
        Self {
            groups,
            place,
            slots: size,
        }
    }

    /// The layout of `cfg`'s KV: grouped by sliding window when `release_windows` (the default), else
    /// one group that keeps every position of every layer.
    pub fn of(cfg: &crate::model::ModelConfig, release_windows: bool) -> Self {
        if !release_windows {
            return Self::single(cfg.num_layers);
        }
        let windows: Vec<Option<usize>> = (0..cfg.num_layers)
            .map(|l| cfg.layer_attention.get(l).and_then(|a| a.window))
            .collect();
        Self::grouped(&windows, &super::row_widths(cfg))
    }

    pub fn groups(&self) -> &[KvGroup] {
        &self.groups
    }

    pub fn group_windows(&self) -> Vec<Option<usize>> {
        self.groups.iter().map(|g| g.window).collect()
    }

    /// Row arrays the storage keeps (layers per group).
    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn num_layers(&self) -> usize {
        self.place.len()
    }

    /// The group whose block table layer `l` reads.
    pub fn group_of(&self, layer: usize) -> usize {
        self.place[layer].0
    }

    /// The storage slot of layer `l`'s rows.
    pub fn slot_of(&self, layer: usize) -> usize {
        self.place[layer].1
    }

    /// Row widths per slot (every group's i-th layer has the widths of the first group's).
    pub fn slot_widths(&self, widths: &[RowWidths]) -> Vec<RowWidths> {
        self.groups[0].layers.iter().map(|&l| widths[l]).collect()
    }

    /// Pool blocks with the memory of `single_blocks` blocks of the single layout: a block here holds
    /// `slots` layers' rows instead of every layer's. The KV budget in bytes stays what it was.
    pub fn blocks_for_budget(&self, single_blocks: usize) -> usize {
        single_blocks * self.num_layers() / self.slots.max(1)
    }

    /// Blocks one sequence of `positions` positions holds between steps, all groups together.
    pub fn blocks_held(&self, positions: usize) -> usize {
        self.groups
            .iter()
            .map(|g| held_in_group(g.window, positions))
            .sum()
    }

    /// The longest sequence a pool of `total_blocks` holds alone between steps.
    pub fn max_positions(&self, total_blocks: usize) -> usize {
        self.max_positions_with_steps(total_blocks, 0)
    }

    /// The longest sequence a pool of `total_blocks` holds alone while steps of up to `step_tokens`
    /// positions run (what the scheduler admits): a sliding group holds a step's new blocks before
    /// the ones that step moves out of the window are given back.
    pub fn max_positions_with_steps(&self, total_blocks: usize, step_tokens: usize) -> usize {
        let sliding = self.groups.iter().filter(|g| g.window.is_some()).count();
        // A step's new blocks, plus the partial block it starts in.
        let per_group = blocks_for(step_tokens) + usize::from(step_tokens > 0);
        let in_flight = sliding * per_group;
        let Some(budget) = total_blocks.checked_sub(in_flight) else {
            return 0;
        };
        // blocks_held grows with positions: binary search on whole blocks.
        let (mut lo, mut hi) = (0usize, total_blocks);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.blocks_held(mid * BLOCK) <= budget {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo * BLOCK
    }
}

/// First position a sliding group must keep once `len` positions are written: the window of the next
/// query (at `len`), widened back to the start of `len`'s block so the cache can still be cut back to a
/// block boundary (prefix caching) and resume there.
pub fn first_kept_position(window: usize, len: usize) -> usize {
    (len / BLOCK * BLOCK).saturating_sub(window - 1)
}

/// Blocks a group holds for a sequence of `positions` positions.
fn held_in_group(window: Option<usize>, positions: usize) -> usize {
    let all = blocks_for(positions);
    match window {
        None => all,
        Some(w) => all - first_kept_position(w, positions) / BLOCK,
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(w: usize) -> Vec<RowWidths> {
        vec![RowWidths { a: 8, b: 8, c: 0 }; w]
    }

    /// SmallThinker-21B: layer 0 of every four is full, the others slide over 4096 positions.
    #[test]
    fn smallthinker_21b_groups_and_bytes_at_16k() {
        let windows: Vec<_> = (0..52).map(|l| (l % 4 != 0).then_some(4096usize)).collect();
        let layout = KvLayout::grouped(&windows, &kv(52));
        assert_eq!((layout.groups().len(), layout.slots()), (4, 13));
        assert_eq!(layout.groups()[0].window, None);
        assert_eq!(
            layout.groups()[0].layers,
            (0..52).step_by(4).collect::<Vec<_>>()
        );
        assert_eq!((layout.group_of(5), layout.slot_of(5)), (1, 3));
        assert_eq!((layout.group_of(4), layout.slot_of(4)), (0, 1));
        // 16K positions: 1024 full blocks + 3 × 256 sliding ones, of 13 layers each.
        assert_eq!(layout.blocks_held(16384), 1024 + 3 * 256);
        let single_layer_blocks = 1024 * 52;
        let grouped_layer_blocks = layout.blocks_held(16384) * 13;
        assert_eq!(grouped_layer_blocks * 100 / single_layer_blocks, 43);
        // The same bytes as a 16K single-layout pool hold one sequence of more than three times that.
        let total = layout.blocks_for_budget(1024);
        assert_eq!(total, 4096);
        let max = layout.max_positions(total);
        assert!(layout.blocks_held(max) <= total && layout.blocks_held(max + BLOCK) > total);
        assert!(max > 3 * 16384, "{max}");
        // With steps of 2048 positions in flight, each sliding group needs 129 blocks more.
        let stepped = layout.max_positions_with_steps(total, 2048);
        assert!(layout.blocks_held(stepped) + 3 * 129 <= total, "{stepped}");
        assert!(stepped > 2 * 16384 && stepped < max, "{stepped}");
        // Without sliding groups nothing is in flight beyond the positions themselves.
        let single = KvLayout::single(52);
        assert_eq!(single.max_positions_with_steps(1024, 2048), 1024 * BLOCK);
    }

    /// The configs `bench synth-checkpoint` writes for the two released models: the 21B groups by
    /// window, the 4B (no sliding layer) keeps the single table; `--keep-window-kv` keeps it for both.
    #[test]
    fn released_smallthinker_configs() {
        let layout = |name: &str, release: bool| {
            let v = crate::cli::synth::config_like(name).unwrap();
            KvLayout::of(&crate::model::ModelConfig::from_json(&v).unwrap(), release)
        };
        let big = layout("smallthinker-21b", true);
        assert_eq!((big.groups().len(), big.slots()), (4, 13));
        assert_eq!(
            big.group_windows(),
            vec![None, Some(4096), Some(4096), Some(4096)]
        );
        assert_eq!(layout("smallthinker-21b", false), KvLayout::single(52));
        assert_eq!(layout("smallthinker-4b", true), KvLayout::single(32));
    }

    #[test]
    fn uneven_kinds_fall_back_to_one_layer_per_group_and_unlike_rows_to_one_group() {
        let windows = [None, Some(5), Some(5), None, Some(5)];
        let layout = KvLayout::grouped(&windows, &kv(5));
        assert_eq!((layout.groups().len(), layout.slots()), (5, 1));
        assert!((0..5).all(|l| layout.slot_of(l) == 0));
        let mut widths = kv(5);
        widths[1].a = 4;
        assert_eq!(KvLayout::grouped(&windows, &widths), KvLayout::single(5));
        assert_eq!(
            KvLayout::grouped(&[None, None], &kv(2)),
            KvLayout::single(2)
        );
    }

    #[test]
    fn sliding_groups_keep_the_window_back_to_a_block_boundary() {
        assert_eq!(first_kept_position(5, 3), 0);
        assert_eq!(first_kept_position(5, 40), 28);
        assert_eq!(first_kept_position(5, 47), 28);
        assert_eq!(first_kept_position(1, 47), 32);
        assert_eq!(held_in_group(Some(5), 40), 2); // blocks 1 and 2
        assert_eq!(held_in_group(Some(5), 48), 1); // block 2 (the next write reserves block 3)
        assert_eq!(held_in_group(None, 48), 3);
    }
}
