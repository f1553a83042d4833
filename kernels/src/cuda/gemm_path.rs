//! Which cuBLAS call multiplies a phase of expert GEMMs ([`GpuDevice::gemm_bf16_items`]), chosen by
//! measurement per use rather than by a flag.
//!
//! Two paths compute the same products: one `cublasGemmBatchedEx` per distinct row count ("batched":
//! one launch at batch-1 decode, where every chosen expert sees one row, but one launch and one
//! heuristic lookup per expert in a long prompt, where row counts differ), or one
//! `cublasGemmGroupedBatchedEx` for every item whatever its row count ("grouped"). Which is faster
//! depends on the use: the number of distinct row counts, the rows, the projection's shape and the
//! cuBLAS build. So each use ([`GemmUse`]: shape, and log2 buckets of the distinct row counts and of
//! the rows) is measured on its first live calls: after [`SETTLE`] untimed calls of each path (cuBLAS
//! heuristics for new shapes), [`SAMPLES`] timed calls of each in turn, then the path with the lower
//! median cost runs from then on. A call's cost is the larger of the host's time in the call (the
//! launches and the pointer-table upload) and the GPU's time between events recorded around it: a
//! phase is bound by whichever of the two is behind. Events are read without waiting, on later calls.
//!
//! `MOE_GROUPED_GEMM=1` forces the grouped path and `MOE_GROUPED_GEMM=0` the batched one (A/B
//! runs); nothing is measured then. Calls made while the stream is being captured into a CUDA graph
//! are never timed (they run the path chosen so far, batched until a choice is made).
use super::grouped;
use cudarc::driver::sys::{CUevent_flags, CUstreamCaptureStatus};
use cudarc::driver::{CudaEvent, CudaStream, DriverError};
use std::collections::HashMap;
use std::sync::Mutex;

/// Untimed calls of each path per use before its timed ones.
pub const SETTLE: usize = 2;
/// Timed calls of each path per use; the choice compares their medians.
pub const SAMPLES: usize = 5;

/// One of the two ways of computing a phase's expert GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertGemmPath {
    /// One `cublasGemmBatchedEx` per distinct row count.
    Batched,
    /// One `cublasGemmGroupedBatchedEx` for all items.
    Grouped,
}

impl ExpertGemmPath {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batched => "batched",
            Self::Grouped => "grouped",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    /// The path `MOE_GROUPED_GEMM` forces, if it does (`1` grouped, `0` batched).
    fn forced_by_env() -> Option<Self> {
        match std::env::var("MOE_GROUPED_GEMM").as_deref() {
            Ok("1") => Some(Self::Grouped),
            Ok("0") => Some(Self::Batched),
            _ => None,
        }
    }
}

/// A use of the expert GEMMs, as far as the path's cost depends on it: the projection (`m` outputs,
/// `k` inputs) and log2 buckets (⌊log2⌋ + 1, 0 for none) of the items' distinct row counts and of
/// their rows in all. Batch-1 decode is 1 row count of ~top-k rows; a long prompt's chunk ~20 row
/// counts of ~16 K rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GemmUse {
    pub m: usize,
    pub k: usize,
    pub row_counts_log2: u32,
    pub rows_log2: u32,
}

impl GemmUse {
    /// The use of items whose row counts, in ascending order, are `sorted_rows` (zeros left out).
    pub fn of(m: usize, k: usize, sorted_rows: impl IntoIterator<Item = usize>) -> Self {
        let (mut distinct, mut total, mut last) = (0usize, 0usize, None);
        for r in sorted_rows {
            if last != Some(r) {
                distinct += 1;
                last = Some(r);
            }
            total += r;
        }
        let bucket = |v: usize| usize::BITS - v.leading_zeros();
        Self {
            m,
            k,
            row_counts_log2: bucket(distinct),
            rows_log2: bucket(total),
        }
    }
}

/// What was measured for one use, and what it runs (for reports).
#[derive(Clone, Debug)]
pub struct GemmChoice {
    pub r#use: GemmUse,
    /// Median cost per call of each path in ms (index: batched, grouped), once measured.
    pub median_ms: [Option<f64>; 2],
    pub chosen: Option<ExpertGemmPath>,
}

impl std::fmt::Display for GemmChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let u = &self.r#use;
        let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3} ms"));
        write!(
            f,
            "{}x{}, <2^{} row counts, <2^{} rows: batched {}, grouped {} -> {}",
            u.m,
            u.k,
            u.row_counts_log2,
            u.rows_log2,
            ms(self.median_ms[0]),
            ms(self.median_ms[1]),
            self.chosen.map_or("measuring", ExpertGemmPath::as_str)
        )
    }
}

/// A timed call whose events have not been read yet.
struct Pending {
    path: ExpertGemmPath,
    start: CudaEvent,
    end: CudaEvent,
    host_ms: f64,
}

#[derive(Default)]
struct UseState {
    /// Calls made of each path (settling included).
    calls: [usize; 2],
    /// Costs of the timed calls in ms, per path.
    samples: [Vec<f64>; 2],
    pending: Vec<Pending>,
    chosen: Option<ExpertGemmPath>,
}

impl UseState {
    /// Reads the events of pending calls that have finished; the choice once both paths have
    /// [`SAMPLES`] costs.
    fn collect(&mut self, r#use: GemmUse) -> Result<(), DriverError> {
        let mut i = 0;
        while i < self.pending.len() {
            if !self.pending[i].end.try_is_complete()? {
                i += 1;
                continue;
            }
            let p = self.pending.swap_remove(i);
            let gpu_ms = p.start.elapsed_ms(&p.end)? as f64;
            self.samples[p.path.index()].push(p.host_ms.max(gpu_ms));
        }
        if self.chosen.is_none() && self.samples.iter().all(|s| s.len() >= SAMPLES) {
            let [b, g] = [0, 1].map(|i| median(&self.samples[i]));
            let path = if g < b {
                ExpertGemmPath::Grouped
            } else {
                ExpertGemmPath::Batched
            };
            self.chosen = Some(path);
            self.pending.clear();
            eprintln!(
                "expert GEMM path: {}",
                GemmChoice {
                    r#use,
                    median_ms: [Some(b), Some(g)],
                    chosen: Some(path)
                }
            );
        }
        Ok(())
    }

    /// The path of the next call and whether to time it.
    fn next(&self) -> (ExpertGemmPath, bool) {
        if let Some(p) = self.chosen {
            return (p, false);
        }
        // alternate: the path with fewer calls so far, batched first
        let path = if self.calls[1] < self.calls[0] {
            ExpertGemmPath::Grouped
        } else {
            ExpertGemmPath::Batched
        };
        let timed =
            self.calls[path.index()] >= SETTLE && self.calls[path.index()] < SETTLE + SAMPLES;
        (path, timed)
    }
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// The per-device record of measurements and choices.
pub(crate) struct PathChooser {
    forced: Option<ExpertGemmPath>,
    uses: Mutex<HashMap<GemmUse, UseState>>,
}

/// How to run one call: the path, and the start event and host clock when it is timed.
pub(crate) struct Planned {
    pub path: ExpertGemmPath,
    timing: Option<(CudaEvent, std::time::Instant)>,
}

impl PathChooser {
    pub(crate) fn from_env() -> Self {
        Self {
            forced: ExpertGemmPath::forced_by_env(),
            uses: Mutex::new(HashMap::new()),
        }
    }

    /// The path forced by `MOE_GROUPED_GEMM`, if any.
    pub(crate) fn forced(&self) -> Option<ExpertGemmPath> {
        self.forced
    }

    /// The path of the next call of `use` on `stream`, with its start event recorded when timed.
    pub(crate) fn plan(&self, r#use: GemmUse, stream: &CudaStream) -> Result<Planned, DriverError> {
        if grouped::grouped_gemm_refused() {
            return Ok(Planned {
                path: ExpertGemmPath::Batched,
                timing: None,
            });
        }
        if let Some(path) = self.forced {
            return Ok(Planned { path, timing: None });
        }
        let mut uses = self.uses.lock().unwrap_or_else(|e| e.into_inner());
        let st = uses.entry(r#use).or_default();
        st.collect(r#use)?;
        let (path, timed) = st.next();
        let capturing =
            stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if capturing {
            // a captured call is not run now: nothing to time, and it does not count
            return Ok(Planned {
                path: st.chosen.unwrap_or(ExpertGemmPath::Batched),
                timing: None,
            });
        }
        st.calls[path.index()] += 1;
        let timing = if timed {
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            Some((start, std::time::Instant::now()))
        } else {
            None
        };
        Ok(Planned { path, timing })
    }

    /// Records the end of a planned call that ran `ran` (the batched fallback when cuBLAS refused
    /// the grouped call: then the sample is dropped).
    pub(crate) fn finish(
        &self,
        r#use: GemmUse,
        planned: Planned,
        ran: ExpertGemmPath,
        stream: &CudaStream,
    ) -> Result<(), DriverError> {
        let Some((start, t0)) = planned.timing else {
            return Ok(());
        };
        if ran != planned.path {
            return Ok(());
        }
        let host_ms = t0.elapsed().as_secs_f64() * 1e3;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let mut uses = self.uses.lock().unwrap_or_else(|e| e.into_inner());
        uses.entry(r#use).or_default().pending.push(Pending {
            path: ran,
            start,
            end,
            host_ms,
        });
        Ok(())
    }

    /// Every use seen so far, with its measurements and choice, in shape order.
    pub(crate) fn choices(&self) -> Vec<GemmChoice> {
        let mut uses = self.uses.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<GemmChoice> = uses
            .iter_mut()
            .map(|(&u, st)| {
                // events of finished calls not read yet
                let _ = st.collect(u);
                GemmChoice {
                    r#use: u,
                    median_ms: [0, 1].map(|i| {
                        let s = &st.samples[i];
                        (!s.is_empty()).then(|| median(s))
                    }),
                    chosen: st.chosen,
                }
            })
            .collect();
        out.sort_by_key(|c| c.r#use);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_bucket_distinct_row_counts_and_rows() {
        // batch-1 decode: 8 experts of one row each
        let decode = GemmUse::of(1536, 2048, [1; 8]);
        assert_eq!((decode.row_counts_log2, decode.rows_log2), (1, 4));
        // a long prompt's chunk: 20 distinct row counts
        let chunk = GemmUse::of(1536, 2048, (0..20).map(|i| 700 + i));
        assert_eq!((chunk.row_counts_log2, chunk.rows_log2), (5, 14));
        assert_eq!(GemmUse::of(4, 4, []).rows_log2, 0);
        // repeated counts are one
        assert_eq!(GemmUse::of(4, 4, [3, 3, 5, 5, 5]).row_counts_log2, 2);
    }

    #[test]
    fn paths_alternate_settle_then_time_then_stay_chosen() {
        let mut st = UseState::default();
        let mut seen = Vec::new();
        for _ in 0..2 * (SETTLE + SAMPLES) {
            let (path, timed) = st.next();
            st.calls[path.index()] += 1;
            seen.push((path, timed));
        }
        let timed: Vec<_> = seen.iter().filter(|(_, t)| *t).collect();
        assert_eq!(timed.len(), 2 * SAMPLES);
        assert_eq!(seen[0], (ExpertGemmPath::Batched, false));
        assert_eq!(seen[1], (ExpertGemmPath::Grouped, false));
        assert_eq!(seen[2 * SETTLE], (ExpertGemmPath::Batched, true));
        // beyond the samples nothing more is timed until the choice is made from them
        assert!(!st.next().1);
        st.samples = [vec![2.0; SAMPLES], vec![1.0, 1.0, 1.0, 9.0, 9.0]];
        st.collect(GemmUse::of(1, 1, [1])).unwrap();
        assert_eq!(st.chosen, Some(ExpertGemmPath::Grouped));
        assert_eq!(st.next(), (ExpertGemmPath::Grouped, false));
        // ties keep the batched path (no new cuBLAS entry point for nothing)
        let mut tie = UseState {
            samples: [vec![1.0; SAMPLES], vec![1.0; SAMPLES]],
            ..Default::default()
        };
        tie.collect(GemmUse::of(1, 1, [1])).unwrap();
        assert_eq!(tie.chosen, Some(ExpertGemmPath::Batched));
    }
}
