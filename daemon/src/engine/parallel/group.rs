//! One step over a tensor-parallel group, driven from one process: rank 0 runs on the engine thread
//! (it owns the CPU expert hand-off and the routing callbacks), every other rank on a scoped thread of
//! its own; each runs the ordinary GPU step over its shard and meets the others in the all-reduces.
//! The logits come back per rank (its vocabulary rows) and are joined on the host.
//!
//! Cost: one thread spawn per other rank per step (tens of microseconds beside steps of milliseconds).
use super::comm::Communicator;
use crate::engine::gpu::forward::GpuSeqInput;
use crate::engine::gpu::GpuModel;
use crate::engine::kv::blocks::BlockCopy;
use crate::engine::kv::BlockId;
use crate::engine::StepTimes;
use crate::model::Model;
use anyhow::Context;
use cudarc::driver::CudaSlice;
use std::sync::Arc;

/// The GPUs of a group other than rank 0 (which is the engine's `GpuModel`), and the communicator
/// they share.
pub struct TpGroup {
    /// Ranks 1..N.
    pub peers: Vec<GpuModel>,
    pub comm: Arc<dyn Communicator>,
}

impl TpGroup {
    /// GPUs in the group.
    pub fn world(&self) -> usize {
        self.peers.len() + 1
    }

    /// One step of every rank; rank 0 is `first`. Returns the full logits of each entry.
    pub fn forward(
        &self,
        first: &GpuModel,
        host: &Model,
        cpu_pool: Option<&moe_kernels::cpu::WorkerPool>,
        batch: &mut [GpuSeqInput<'_>],
        times: &mut StepTimes,
        on_routing: impl FnMut(usize, &[u32]),
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        // Each rank gets its own slot of every sequence's recurrent state (its heads' part).
        let mut peer_states: Vec<Vec<Option<&mut Option<CudaSlice<f32>>>>> =
            self.peers.iter().map(|_| Vec::new()).collect();
        for b in batch.iter_mut() {
            let mut rest = match b.state.take() {
                Some(slots) => {
                    let (first, rest) = slots.split_first_mut().with_context(|| {
                        "a sequence's recurrent state has no slot for GPU 0".to_string()
                    })?;
                    b.state = Some(std::slice::from_mut(first));
                    anyhow::ensure!(
                        rest.len() >= self.peers.len(),
                        "a sequence's recurrent state has slots for {} GPUs, the group has {}",
                        rest.len() + 1,
                        self.world()
                    );
                    rest.iter_mut().map(Some).collect()
                }
                None => Vec::new(),
            }
            .into_iter();
            for p in peer_states.iter_mut() {
                p.push(rest.next().flatten());
            }
        }
        let peer_batches: Vec<Vec<GpuSeqInput<'_>>> = peer_states
            .into_iter()
            .map(|states| {
                batch
                    .iter()
                    .zip(states)
                    .map(|(b, state)| GpuSeqInput {
                        tables: b.tables.clone(),
                        pos0: b.pos0,
                        tokens: b.tokens,
                        state: state.map(std::slice::from_mut),
                    })
                    .collect()
            })
            .collect();
        let comm = &self.comm;
        // every rank thread of the previous step has been joined: no one is inside a reduction
        comm.reset();
        let stepping = first.shard.as_ref().map(|s| s.group_step.clone());
        let _stepping = stepping.as_deref().map(super::rank::GroupStep::enter);
        let (first_out, peer_outs) = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .peers
                .iter()
                .zip(peer_batches)
                .map(|(g, mut inputs)| {
                    scope.spawn(move || {
                        release_inherited_pin();
                        let out = peer_step(g, host, &mut inputs);
                        if out.is_err() {
                            comm.abort();
                        }
                        out
                    })
                })
                .collect();
            let first_out = first
                .dev
                .ctx
                .bind_to_thread()
                .map_err(anyhow::Error::from)
                .and_then(|()| first.forward(host, cpu_pool, batch, times, on_routing));
            if first_out.is_err() {
                comm.abort();
            }
            let peer_outs: Vec<anyhow::Result<Vec<Vec<f32>>>> = handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a tensor-parallel rank panicked")))
                })
                .collect();
            (first_out, peer_outs)
        });
        let mut out = first_out.context("tensor-parallel rank 0")?;
        for (r, part) in peer_outs.into_iter().enumerate() {
            let part = part.with_context(|| format!("tensor-parallel rank {}", r + 1))?;
            for (row, more) in out.iter_mut().zip(part) {
                row.extend(more);
            }
        }
        Ok(out)
    }

    /// Copy-on-write of KV blocks in every rank's pool (rank 0's copier first).
    pub fn block_copier(&self, first: Arc<dyn BlockCopy>) -> Arc<dyn BlockCopy> {
        let mut all = vec![first];
        for g in &self.peers {
            all.push(Arc::new(crate::engine::gpu::kv::GpuKvCopier {
                pool: g.kv.clone(),
                stream: g.dev.stream.clone(),
            }));
        }
        Arc::new(EveryRank(all))
    }
}

/// A rank thread is spawned by rank 0's host thread, which the CPU expert pool pinned to the one CPU
/// it computes its share of the experts on; inherited, that pin would put every rank's host loop
/// (launches, polling for its routing) on that CPU beside it. The rank thread runs on any CPU of the
/// process instead (best effort: left pinned if the kernel refuses).
fn release_inherited_pin() {
    #[cfg(target_os = "linux")]
    {
        let cpus = moe_kernels::cpu::topology::allowed_cpus();
        // SAFETY: plain-data cpu_set_t; every index is checked against CPU_SETSIZE.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
                libc::CPU_SET(c, &mut set);
            }
            if !cpus.is_empty() {
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
        }
    }
}

/// A rank other than 0: no CPU pool (the DRAM experts are rank 0's), no routing callbacks, its own
/// timings dropped.
fn peer_step(
    g: &GpuModel,
    host: &Model,
    inputs: &mut [GpuSeqInput<'_>],
) -> anyhow::Result<Vec<Vec<f32>>> {
    g.dev.ctx.bind_to_thread()?;
    let mut times = StepTimes::default();
    g.forward(host, None, inputs, &mut times, |_, _| {})
}

/// A block copy made in each rank's KV pool.
struct EveryRank(Vec<Arc<dyn BlockCopy>>);

impl BlockCopy for EveryRank {
    fn copy_block(&self, from: BlockId, to: BlockId) -> Result<(), String> {
        self.0.iter().try_for_each(|c| c.copy_block(from, to))
    }
}
