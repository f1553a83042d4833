//! Which path multiplies a phase of expert GEMMs ([`GpuDevice::gemm_bf16_items`]), per use.
//!
//! Two paths compute the same products: one cuBLAS `cublasGemmBatchedEx` per distinct row count
//! ("batched": one launch at batch-1 decode, where every chosen expert sees one row, but one launch and
//! one heuristic lookup per expert in a long prompt, where row counts differ), or one launch of the
//! grouped kernel for every item whatever its row count ("grouped", `grouped.rs`). The rule is fixed
//! per use ([`GemmUse`]) from measurements on the H200 (docs/PERF.md, "Expert GEMM paths"): items with
//! at least [`GROUPED_FROM_ROW_COUNTS`] distinct row counts go grouped, the rest batched. It is a rule
//! and not a measurement at run time so that a process's numbers do not depend on timing noise: the two
//! paths sum in different orders (f32, within 1e-5 relative of each other).
//!
//! `MOE_GROUPED_GEMM=1` forces the grouped path and `MOE_GROUPED_GEMM=0` the batched one (A/B runs).
//!
//! [`GpuDevice::gemm_bf16_items`]: super::GpuDevice::gemm_bf16_items
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Distinct row counts from which a phase's expert GEMMs go grouped (the batched path would make this
/// many cuBLAS calls per projection).
pub const GROUPED_FROM_ROW_COUNTS: usize = 4;

/// One of the two ways of computing a phase's expert GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertGemmPath {
    /// One `cublasGemmBatchedEx` per distinct row count.
    Batched,
    /// One launch of the grouped kernel for all items.
    Grouped,
}

impl ExpertGemmPath {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batched => "batched",
            Self::Grouped => "grouped",
        }
    }

    /// The path `MOE_GROUPED_GEMM` forces, if it does (`1` grouped, `0` batched).
    fn forced_by_env() -> Option<Self> {
        match std::env::var("MOE_GROUPED_GEMM").as_deref() {
            Ok("1") => Some(Self::Grouped),
            Ok("0") => Some(Self::Batched),
            _ => None,
        }
    }

    /// The rule's path for `use`.
    pub fn for_use(r#use: &GemmUse) -> Self {
        if r#use.row_counts >= GROUPED_FROM_ROW_COUNTS {
            Self::Grouped
        } else {
            Self::Batched
        }
    }
}

/// A use of the expert GEMMs: the projection (`m` outputs, `k` inputs), the items' distinct row
/// counts and their rows in all. Batch-1 decode is 1 row count of ~top-k rows; a long prompt's chunk
/// ~20 row counts of ~16 K rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GemmUse {
    pub m: usize,
    pub k: usize,
    pub row_counts: usize,
    pub rows: usize,
}

impl GemmUse {
    /// The use of items whose row counts, in ascending order, are `sorted_rows` (zeros left out).
    pub fn of(m: usize, k: usize, sorted_rows: impl IntoIterator<Item = usize>) -> Self {
        let (mut row_counts, mut rows, mut last) = (0usize, 0usize, None);
        for r in sorted_rows {
            if last != Some(r) {
                row_counts += 1;
                last = Some(r);
            }
            rows += r;
        }
        Self {
            m,
            k,
            row_counts,
            rows,
        }
    }

    /// The kind of use, for reports: log2 buckets of the row counts and rows.
    fn kind(&self) -> UseKind {
        let bucket = |v: usize| usize::BITS - v.leading_zeros();
        UseKind {
            m: self.m,
            k: self.k,
            row_counts_log2: bucket(self.row_counts),
            rows_log2: bucket(self.rows),
        }
    }
}

/// Uses of one kind (shape, and ⌊log2⌋ + 1 of the row counts and of the rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UseKind {
    pub m: usize,
    pub k: usize,
    pub row_counts_log2: u32,
    pub rows_log2: u32,
}

/// Calls of one kind of use on one path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UseCount {
    pub kind: UseKind,
    pub path: ExpertGemmPath,
    pub calls: u64,
}

impl std::fmt::Display for UseCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let u = &self.kind;
        write!(
            f,
            "{}x{}, < 2^{} row counts, < 2^{} rows: {} calls {}",
            u.m,
            u.k,
            u.row_counts_log2,
            u.rows_log2,
            self.calls,
            self.path.as_str()
        )
    }
}

/// The per-device path choice and the count of calls per kind of use.
pub(crate) struct PathChooser {
    forced: Option<ExpertGemmPath>,
    calls: Mutex<BTreeMap<(UseKind, ExpertGemmPath), u64>>,
}

impl PathChooser {
    pub(crate) fn from_env() -> Self {
        Self {
            forced: ExpertGemmPath::forced_by_env(),
            calls: Mutex::new(BTreeMap::new()),
        }
    }

    /// The path forced by `MOE_GROUPED_GEMM`, if any.
    pub(crate) fn forced(&self) -> Option<ExpertGemmPath> {
        self.forced
    }

    /// The path of a call of `use` (counted).
    pub(crate) fn path(&self, r#use: GemmUse) -> ExpertGemmPath {
        let path = self.forced.unwrap_or(ExpertGemmPath::for_use(&r#use));
        self.count(r#use, path);
        path
    }

    /// Counts a call of `use` on `path` (chosen by the caller).
    pub(crate) fn count(&self, r#use: GemmUse, path: ExpertGemmPath) {
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        *calls.entry((r#use.kind(), path)).or_default() += 1;
    }

    /// Calls so far per kind of use and path.
    pub(crate) fn uses(&self) -> Vec<UseCount> {
        let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls
            .iter()
            .map(|(&(kind, path), &calls)| UseCount { kind, path, calls })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_count_distinct_row_counts_and_rows() {
        // batch-1 decode: 8 experts of one row each
        let decode = GemmUse::of(1536, 2048, [1; 8]);
        assert_eq!((decode.row_counts, decode.rows), (1, 8));
        let k = decode.kind();
        assert_eq!((k.row_counts_log2, k.rows_log2), (1, 4));
        // a long prompt's chunk: 20 distinct row counts
        let chunk = GemmUse::of(1536, 2048, (0..20).map(|i| 700 + i));
        assert_eq!(chunk.row_counts, 20);
        assert_eq!(GemmUse::of(4, 4, []).rows, 0);
        assert_eq!(GemmUse::of(4, 4, [3, 3, 5, 5, 5]).row_counts, 2);
    }

    #[test]
    fn many_row_counts_go_grouped() {
        let path = |rows: &[usize]| ExpertGemmPath::for_use(&GemmUse::of(64, 64, rows.to_vec()));
        assert_eq!(path(&[1; 8]), ExpertGemmPath::Batched, "batch-1 decode");
        assert_eq!(path(&[1, 2, 3]), ExpertGemmPath::Batched);
        assert_eq!(path(&[1, 2, 3, 4]), ExpertGemmPath::Grouped);
        let chooser = PathChooser {
            forced: None,
            calls: Mutex::new(BTreeMap::new()),
        };
        chooser.path(GemmUse::of(64, 64, [1; 7]));
        chooser.path(GemmUse::of(64, 64, [1; 6]));
        let uses = chooser.uses();
        assert_eq!(
            uses.len(),
            1,
            "one kind (7 and 6 rows share a bucket): {uses:?}"
        );
        assert_eq!(uses[0].calls, 2);
    }
}
