//! Where one MoE layer's routed experts run in a GPU step, decided on the host from the routing, the
//! experts' residency and the layer's streamed chunks: a pure [`MoeDispatchPlan`] that the step's
//! phases only execute (`run_gpu_experts` and `combine_gpu` in `moe_layer`; the DRAM experts'
//! `CpuHalf`, whose sum the GPU adds through the `handoff` flag).
//!
//! Each expert has a home for the step ([`ExpertHome`]): resident on the GPU, computed by the CPU
//! kernels from DRAM (decode and short prompts), streamed to the GPU in the layer's chunks, or
//! uploaded one by one (long prompts whose DRAM experts cannot be streamed). The plan groups the
//! routed (token, weight) rows of the GPU experts so that each phase's rows are one consecutive
//! range — resident and uploaded experts first, then chunk by chunk in stream order — and builds the
//! per-token index that sums them back in a fixed order.
use crate::engine::moe::{Routing, NOT_HERE};
use std::ops::Range;

/// Where an expert of the layer is computed in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertHome {
    /// In GPU memory.
    Resident,
    /// In DRAM, computed by the CPU kernels beside the GPU's work.
    Cpu,
    /// In DRAM, sent to the GPU in the layer's stream chunks (long prompts).
    Streamed,
    /// In DRAM, uploaded for this step (long prompts without the stream).
    Uploaded,
    /// Computed by another GPU of a tensor-parallel group (see `engine::parallel`).
    Peer,
    /// Resident, already computed from the routing on the device (`routed`) before the host saw it.
    DeviceRouted,
    /// In DRAM, computed in this decode step by the GPU's side stream from a copy (`decode_split`),
    /// its sum joined on the host: neither the plan's GPU phases nor the CPU routing hold it.
    Shared,
}

/// Every expert's home in a step: `resident` from the layer's expert table; `long_prompt` for
/// layerwise-prefill steps, where DRAM experts go to the GPU (through the stream when `streamed`)
/// instead of the CPU, except those `cpu_in_prefill` keeps on the CPU (placement rules; shorter
/// than the experts: the rest are not kept).
pub fn expert_homes(
    resident: &[bool],
    long_prompt: bool,
    streamed: bool,
    cpu_in_prefill: &[bool],
) -> Vec<ExpertHome> {
    resident
        .iter()
        .enumerate()
        .map(|(e, &r)| {
            let kept_on_cpu = cpu_in_prefill.get(e).copied().unwrap_or(false);
            match (r, long_prompt, streamed) {
                (true, _, _) => ExpertHome::Resident,
                (false, false, _) => ExpertHome::Cpu,
                (false, true, _) if kept_on_cpu => ExpertHome::Cpu,
                (false, true, true) => ExpertHome::Streamed,
                (false, true, false) => ExpertHome::Uploaded,
            }
        })
        .collect()
}

/// Distinct experts among routed `ids` ([`NOT_HERE`] left out): the experts whose weights a
/// layer's CPU kernels read once each for all their rows.
pub fn distinct_experts(ids: &[u32]) -> usize {
    let mut seen: Vec<u32> = ids.iter().copied().filter(|&id| id != NOT_HERE).collect();
    seen.sort_unstable();
    seen.dedup();
    seen.len()
}

/// Experts with consecutive rows computed on the GPU together: the resident (and uploaded) experts,
/// or the routed experts of one streamed chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phase {
    /// `None`: resident / uploaded experts; `Some(c)`: stream chunk `c` (taken even when none of
    /// its experts was routed, so the stream stays in order).
    pub chunk: Option<usize>,
    /// Indices into [`MoeDispatchPlan::groups`].
    pub groups: Range<usize>,
}

/// One GPU expert's rows: `rows` routed rows from `row0` of the gathered buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertGroup {
    pub expert: usize,
    pub row0: usize,
    pub rows: usize,
}

/// The dispatch of one MoE layer in one step.
#[derive(Default)]
pub struct MoeDispatchPlan {
    /// Token and routing weight of each gathered GPU row; each group's rows are consecutive.
    pub row_token: Vec<i32>,
    pub row_weight: Vec<f32>,
    pub groups: Vec<ExpertGroup>,
    /// The resident phase first, then one phase per streamed chunk of the layer, in stream order.
    pub phases: Vec<Phase>,
    /// Experts to upload before the resident phase (long prompts without the stream).
    pub uploads: Vec<usize>,
    /// Token t's GPU rows are `token_rows[token_offsets[t]..token_offsets[t + 1]]` (ascending), the
    /// order the combine sums them in.
    pub token_offsets: Vec<i32>,
    pub token_rows: Vec<i32>,
    /// The CPU experts' routing (other ids [`NOT_HERE`]); `None` when no CPU expert was routed.
    pub cpu: Option<Routing>,
    /// Routed (token, expert) pairs, and those served by resident experts.
    pub expert_hits: u64,
    pub gpu_expert_hits: u64,
}

impl MoeDispatchPlan {
    /// Plans a layer from its routing (`ids` and `weights`, `[tokens × top_k]`), each expert's
    /// `home`, and the expert ids of the layer's stream chunks in stream order (`(chunk, ids)`).
    pub fn new(
        ids: &[u32],
        weights: &[f32],
        top_k: usize,
        home: &[ExpertHome],
        chunks: &[(usize, &[u32])],
    ) -> Self {
        let tokens = ids.len() / top_k.max(1);
        // (token, weight) rows of each expert, in token order
        let mut per_expert: Vec<Vec<(i32, f32)>> = vec![Vec::new(); home.len()];
        let mut cpu = vec![NOT_HERE; ids.len()];
        let mut cpu_w = vec![0f32; ids.len()];
        let mut plan = MoeDispatchPlan::default();
        for (j, (&id, &w)) in ids.iter().zip(weights).enumerate() {
            let e = id as usize;
            plan.expert_hits += 1;
            match home[e] {
                ExpertHome::Resident => plan.gpu_expert_hits += 1,
                ExpertHome::Cpu => {
                    cpu[j] = id;
                    cpu_w[j] = w;
                    continue;
                }
                ExpertHome::Streamed | ExpertHome::Uploaded => {}
                // another GPU's rows (rank 0 counts them with the GPU hits), or the side stream's
                ExpertHome::Peer | ExpertHome::DeviceRouted | ExpertHome::Shared => {
                    plan.gpu_expert_hits += 1;
                    continue;
                }
            }
            per_expert[e].push(((j / top_k) as i32, w));
        }
        if cpu.iter().any(|&id| id != NOT_HERE) {
            plan.cpu = Some(Routing {
                ids: cpu,
                weights: cpu_w,
                top_k,
            });
        }
        let push = |plan: &mut MoeDispatchPlan, e: usize| {
            let rows = &per_expert[e];
            plan.groups.push(ExpertGroup {
                expert: e,
                row0: plan.row_token.len(),
                rows: rows.len(),
            });
            plan.row_token.extend(rows.iter().map(|r| r.0));
            plan.row_weight.extend(rows.iter().map(|r| r.1));
        };
        for e in 0..home.len() {
            let here = matches!(home[e], ExpertHome::Resident | ExpertHome::Uploaded);
            if here && !per_expert[e].is_empty() {
                push(&mut plan, e);
                if home[e] == ExpertHome::Uploaded {
                    plan.uploads.push(e);
                }
            }
        }
        plan.phases.push(Phase {
            chunk: None,
            groups: 0..plan.groups.len(),
        });
        for &(c, chunk_ids) in chunks {
            let g0 = plan.groups.len();
            for &id in chunk_ids {
                let e = id as usize;
                if home.get(e) == Some(&ExpertHome::Streamed) && !per_expert[e].is_empty() {
                    push(&mut plan, e);
                }
            }
            plan.phases.push(Phase {
                chunk: Some(c),
                groups: g0..plan.groups.len(),
            });
        }
        (plan.token_offsets, plan.token_rows) = rows_by_token(&plan.row_token, tokens);
        plan
    }

    /// Routed rows computed on the GPU.
    pub fn gpu_rows(&self) -> usize {
        self.row_token.len()
    }

    /// Whether the GPU has expert work (rows to compute, or stream chunks to consume).
    pub fn any_gpu_work(&self) -> bool {
        self.gpu_rows() > 0 || self.phases.iter().any(|p| p.chunk.is_some())
    }

    /// The groups of phase `p`.
    pub fn phase_groups(&self, p: &Phase) -> &[ExpertGroup] {
        &self.groups[p.groups.clone()]
    }
}

/// CSR of rows by token: `offsets` (`tokens + 1`) and the rows of each token in ascending order.
fn rows_by_token(row_token: &[i32], tokens: usize) -> (Vec<i32>, Vec<i32>) {
    let mut offsets = vec![0i32; tokens + 1];
    for &t in row_token {
        offsets[t as usize + 1] += 1;
    }
    for t in 0..tokens {
        offsets[t + 1] += offsets[t];
    }
    let mut fill = offsets.clone();
    let mut rows = vec![0i32; row_token.len()];
    for (r, &t) in row_token.iter().enumerate() {
        rows[fill[t as usize] as usize] = r as i32;
        fill[t as usize] += 1;
    }
    (offsets, rows)
}

/// Deferred experts (KTransformers' `max_deferred_experts_per_token`): of each token's `top_k` routes,
/// the `defer` with the lowest routing weight (`weights`, all routes of the layer, ties broken
/// towards the later route) are deferred when the CPU serves them: their output is added one layer
/// later, so the CPU computes them while the GPU runs the next layer. Returns the CPU routing split
/// into (now, later); `later` is `None` when nothing is deferred. GPU routes are never deferred (the
/// GPU's share costs no CPU time).
pub fn split_deferred(
    cpu: &Routing,
    weights: &[f32],
    defer: usize,
) -> (Option<Routing>, Option<Routing>) {
    let k = cpu.top_k.max(1);
    let mut now = cpu.clone();
    let mut later = Routing {
        ids: vec![NOT_HERE; cpu.ids.len()],
        weights: vec![0.0; cpu.ids.len()],
        top_k: cpu.top_k,
    };
    let mut order: Vec<usize> = Vec::with_capacity(k);
    for t in 0..cpu.ids.len() / k {
        let row = t * k..(t + 1) * k;
        order.clear();
        order.extend(0..k);
        // lowest weight first; the later route first among equals
        order.sort_by(|&a, &b| {
            weights[row.start + a]
                .total_cmp(&weights[row.start + b])
                .then(b.cmp(&a))
        });
        for &j in order.iter().take(defer.min(k)) {
            let r = row.start + j;
            if cpu.ids[r] != NOT_HERE {
                later.ids[r] = cpu.ids[r];
                later.weights[r] = cpu.weights[r];
                now.ids[r] = NOT_HERE;
                now.weights[r] = 0.0;
            }
        }
    }
    let any = |r: &Routing| r.ids.iter().any(|&id| id != NOT_HERE);
    let later = any(&later).then_some(later);
    let now = any(&now).then_some(now);
    (now, later)
}

#[cfg(test)]
mod tests {
    use super::ExpertHome::{Cpu, Resident, Streamed, Uploaded};
    use super::*;

    #[test]
    fn distinct_experts_count_each_once_and_skip_other_devices() {
        assert_eq!(distinct_experts(&[4, 1, 4, NOT_HERE, 7, 1]), 3);
        assert_eq!(distinct_experts(&[NOT_HERE, NOT_HERE]), 0);
    }

    #[test]
    fn homes_follow_residency_step_kind_and_prefill_rules() {
        let resident = [true, false];
        let homes = |long, streamed, keep: &[bool]| expert_homes(&resident, long, streamed, keep);
        assert_eq!(homes(false, true, &[]), vec![Resident, Cpu]);
        assert_eq!(homes(true, true, &[]), vec![Resident, Streamed]);
        assert_eq!(homes(true, false, &[]), vec![Resident, Uploaded]);
        // a rule keeps experts 0 and 1 on the CPU in long prompts: resident 0 stays on the GPU
        assert_eq!(homes(true, true, &[true, true]), vec![Resident, Cpu]);
        assert_eq!(homes(true, false, &[true, true]), vec![Resident, Cpu]);
    }

    #[test]
    fn decode_splits_gpu_rows_from_cpu_routing() {
        let home = [Resident, Cpu, Resident, Cpu];
        let ids = [0, 1, 2, 0, 3, 2];
        let w = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6];
        let p = MoeDispatchPlan::new(&ids, &w, 2, &home, &[]);
        // expert 0: tokens 0 (0.1) and 1 (0.4); expert 2: tokens 1 (0.3) and 2 (0.6)
        assert_eq!(
            p.groups,
            vec![
                ExpertGroup {
                    expert: 0,
                    row0: 0,
                    rows: 2
                },
                ExpertGroup {
                    expert: 2,
                    row0: 2,
                    rows: 2
                },
            ]
        );
        assert_eq!(p.row_token, vec![0, 1, 1, 2]);
        assert_eq!(p.row_weight, vec![0.1, 0.4, 0.3, 0.6]);
        assert_eq!(
            p.phases,
            vec![Phase {
                chunk: None,
                groups: 0..2
            }]
        );
        let cpu = p.cpu.as_ref().expect("experts 1 and 3 were routed");
        assert_eq!(cpu.ids, vec![NOT_HERE, 1, NOT_HERE, NOT_HERE, 3, NOT_HERE]);
        assert_eq!(cpu.weights, vec![0.0, 0.2, 0.0, 0.0, 0.5, 0.0]);
        assert_eq!((p.expert_hits, p.gpu_expert_hits), (6, 4));
        // token 0: row 0; token 1: rows 1, 2; token 2: row 3
        assert_eq!(p.token_offsets, vec![0, 1, 3, 4]);
        assert_eq!(p.token_rows, vec![0, 1, 2, 3]);
        assert!(p.uploads.is_empty() && p.any_gpu_work());
    }

    #[test]
    fn shared_experts_are_in_neither_the_gpu_phases_nor_the_cpu_routing() {
        use super::ExpertHome::Shared;
        let home = [Cpu, Shared, Resident, Shared];
        let p = MoeDispatchPlan::new(&[1, 0, 3, 2], &[0.1, 0.2, 0.3, 0.4], 2, &home, &[]);
        assert_eq!(
            p.cpu.as_ref().unwrap().ids,
            vec![NOT_HERE, 0, NOT_HERE, NOT_HERE]
        );
        assert_eq!(p.groups.len(), 1, "expert 2 only");
        assert_eq!(p.row_token, vec![1]);
        assert_eq!((p.expert_hits, p.gpu_expert_hits), (4, 3));
    }

    #[test]
    fn all_experts_on_the_cpu_leaves_the_gpu_idle() {
        let p = MoeDispatchPlan::new(&[1, 0], &[0.5, 0.5], 2, &[Cpu, Cpu], &[]);
        assert!(!p.any_gpu_work() && p.groups.is_empty());
        assert_eq!(p.token_offsets, vec![0, 0]);
        assert_eq!(p.cpu.unwrap().ids, vec![1, 0]);
    }

    /// Long prompt with the stream: resident experts form the first phase, then each chunk its own,
    /// in stream order; a chunk none of whose experts was routed is still a phase.
    #[test]
    fn streamed_chunks_are_phases_in_stream_order() {
        let home = [Streamed, Resident, Streamed, Streamed, Streamed];
        // 2 tokens, top-2: token 0 → 3, 1; token 1 → 0, 3
        let ids = [3, 1, 0, 3];
        let w = [1.0, 2.0, 3.0, 4.0];
        let chunks: [(usize, &[u32]); 3] = [(7, &[2, 3]), (8, &[4]), (9, &[0])];
        let p = MoeDispatchPlan::new(&ids, &w, 2, &home, &chunks);
        assert_eq!(
            p.groups,
            vec![
                ExpertGroup {
                    expert: 1,
                    row0: 0,
                    rows: 1
                },
                ExpertGroup {
                    expert: 3,
                    row0: 1,
                    rows: 2
                },
                ExpertGroup {
                    expert: 0,
                    row0: 3,
                    rows: 1
                },
            ]
        );
        assert_eq!(
            p.phases,
            vec![
                Phase {
                    chunk: None,
                    groups: 0..1
                },
                Phase {
                    chunk: Some(7),
                    groups: 1..2
                },
                Phase {
                    chunk: Some(8),
                    groups: 2..2
                },
                Phase {
                    chunk: Some(9),
                    groups: 2..3
                },
            ]
        );
        assert_eq!(p.row_token, vec![0, 0, 1, 1]);
        assert_eq!(p.row_weight, vec![2.0, 1.0, 4.0, 3.0]);
        assert!(p.cpu.is_none() && p.uploads.is_empty());
        assert_eq!(p.token_offsets, vec![0, 2, 4]);
        assert_eq!(p.token_rows, vec![0, 1, 2, 3]);
        assert_eq!(p.gpu_expert_hits, 1);
    }

    #[test]
    fn long_prompt_without_stream_uploads_the_routed_dram_experts() {
        let home = [Uploaded, Resident, Uploaded];
        let p = MoeDispatchPlan::new(&[2, 1, 2, 1], &[1.0; 4], 1, &home, &[]);
        assert_eq!(p.uploads, vec![2], "expert 0 was not routed");
        assert_eq!(
            p.groups,
            vec![
                ExpertGroup {
                    expert: 1,
                    row0: 0,
                    rows: 2
                },
                ExpertGroup {
                    expert: 2,
                    row0: 2,
                    rows: 2
                },
            ]
        );
        // token t is row t's: tokens 1 and 3 (expert 1) are rows 0, 1; tokens 0, 2 rows 2, 3
        assert_eq!(p.token_offsets, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.token_rows, vec![2, 0, 3, 1]);
    }

    /// Every routed pair lands exactly once: on a GPU row with its token and weight, or in the CPU
    /// routing at its own slot; and the combine index lists each row once under its token.
    #[test]
    fn every_routed_pair_is_dispatched_once() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let homes = [Resident, Cpu, Streamed, Uploaded];
        for _ in 0..200 {
            let (experts, top_k, tokens) =
                (16usize, 1 + next() as usize % 4, 1 + next() as usize % 9);
            let home: Vec<ExpertHome> = (0..experts).map(|_| homes[next() as usize % 3]).collect();
            let ids: Vec<u32> = (0..tokens * top_k)
                .map(|_| (next() % experts as u64) as u32)
                .collect();
            let w: Vec<f32> = (0..ids.len()).map(|j| j as f32).collect();
            let streamed: Vec<u32> = (0..experts as u32)
                .filter(|&e| home[e as usize] == Streamed)
                .collect();
            let chunks: Vec<(usize, &[u32])> = streamed.chunks(3).enumerate().collect();
            let p = MoeDispatchPlan::new(&ids, &w, top_k, &home, &chunks);
            let mut seen = vec![false; ids.len()];
            for g in &p.groups {
                for r in g.row0..g.row0 + g.rows {
                    let j = p.row_weight[r] as usize; // the weight encodes the pair's slot
                    assert!(!seen[j] && ids[j] as usize == g.expert);
                    assert_eq!(p.row_token[r] as usize, j / top_k);
                    seen[j] = true;
                }
            }
            if let Some(cpu) = &p.cpu {
                for (j, &id) in cpu.ids.iter().enumerate().filter(|(_, &id)| id != NOT_HERE) {
                    assert!(!seen[j] && id == ids[j] && home[id as usize] == Cpu);
                    seen[j] = true;
                }
            }
            assert!(seen.iter().all(|&s| s), "a routed pair was dropped");
            let mut listed: Vec<i32> = p.token_rows.clone();
            listed.sort_unstable();
            assert_eq!(listed, (0..p.gpu_rows() as i32).collect::<Vec<_>>());
            for t in 0..tokens {
                let rows =
                    &p.token_rows[p.token_offsets[t] as usize..p.token_offsets[t + 1] as usize];
                assert!(rows.iter().all(|&r| p.row_token[r as usize] == t as i32));
            }
        }
    }
    #[test]
    fn deferral_takes_each_tokens_lowest_weight_cpu_routes() {
        // two tokens, top-3; expert 9 is on the GPU (NOT_HERE in the CPU routing)
        let weights = [0.5, 0.2, 0.3, 0.1, 0.1, 0.8];
        let cpu = Routing {
            ids: vec![1, 2, 3, NOT_HERE, 5, 6],
            weights: weights.to_vec(),
            top_k: 3,
        };
        let (now, later) = split_deferred(&cpu, &weights, 1);
        let (now, later) = (now.unwrap(), later.unwrap());
        // token 0 defers expert 2 (0.2); token 1's lowest are the GPU route and expert 5 at 0.1:
        // the later route (expert 5) goes first
        assert_eq!(now.ids, vec![1, NOT_HERE, 3, NOT_HERE, NOT_HERE, 6]);
        assert_eq!(
            later.ids,
            vec![NOT_HERE, 2, NOT_HERE, NOT_HERE, 5, NOT_HERE]
        );
        assert_eq!(later.weights, vec![0.0, 0.2, 0.0, 0.0, 0.1, 0.0]);
        // deferring 2: token 1 keeps only its best route; nothing is lost or doubled
        let (now, later) = split_deferred(&cpu, &weights, 2);
        let (now, later) = (now.unwrap(), later.unwrap());
        for j in 0..6 {
            let served = [now.ids[j], later.ids[j]]
                .iter()
                .filter(|&&i| i != NOT_HERE)
                .count();
            assert_eq!(served, usize::from(cpu.ids[j] != NOT_HERE), "route {j}");
        }
        assert_eq!(now.ids, vec![1, NOT_HERE, NOT_HERE, NOT_HERE, NOT_HERE, 6]);
        // none deferred, or all: one side empty
        assert_eq!(split_deferred(&cpu, &weights, 0), (Some(cpu.clone()), None));
        let (now, later) = split_deferred(&cpu, &weights, 3);
        assert!(now.is_none() && later.unwrap().ids == cpu.ids);
    }
}
