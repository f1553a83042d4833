//! Options of the CPU expert path (threads, NUMA mode, hugepages, tier cap) and the worker pool they
//! describe. The daemon's CLI parses the flags into these types (`FromStr`).

use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;

use super::dense::GroupedInput;
use super::features::CpuTier;
use super::memory::HugepageMode;
use super::pool::{WorkerPool, MAX_GROUPS};
use super::topology::{allowed_cpus, numa_nodes};

/// (NUMA node if bound, CPUs) of one pool group.
type GroupPlan = (Option<usize>, Vec<usize>);

#[derive(Debug, Error, PartialEq, Eq)]
pub enum OptionsError {
    #[error("--cpu-threads: {0}")]
    Threads(String),
    #[error("unknown NUMA mode {0:?} (expected auto or off)")]
    Numa(String),
}

/// `--numa auto`: one pool group per NUMA node holding allowed CPUs, experts partitioned across them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum NumaMode {
    #[default]
    Auto,
    /// One group over all allowed CPUs, memory left to first touch.
    Off,
}

impl FromStr for NumaMode {
    type Err = OptionsError;
    fn from_str(s: &str) -> Result<Self, OptionsError> {
        match s {
            "auto" => Ok(NumaMode::Auto),
            "off" => Ok(NumaMode::Off),
            _ => Err(OptionsError::Numa(s.to_string())),
        }
    }
}

/// Options of the CPU expert path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuMoeOptions {
    /// Worker threads including the caller; `None` = every allowed CPU.
    pub threads: Option<usize>,
    pub numa: NumaMode,
    pub hugepages: HugepageMode,
    /// Highest tier to use (clamped to what the CPU has); `None` = best detected.
    pub max_tier: Option<CpuTier>,
    /// How long idle workers spin before parking.
    pub spin: Duration,
    /// Pin worker threads to CPUs.
    pub pin: bool,
    /// What few-row calls of the dense projections feed grouped int weights; `None`: the accurate
    /// default of each format (`GroupedInput::default_for`).
    pub dense_input: Option<GroupedInput>,
}

impl Default for CpuMoeOptions {
    fn default() -> Self {
        CpuMoeOptions {
            threads: None,
            numa: NumaMode::Auto,
            hugepages: HugepageMode::Auto,
            max_tier: None,
            spin: Duration::from_millis(5),
            pin: true,
            dense_input: None,
        }
    }
}

impl CpuMoeOptions {
    /// The tier kernels will use.
    pub fn tier(&self) -> CpuTier {
        self.max_tier.unwrap_or(CpuTier::Amx).clamp_to_cpu()
    }

    /// CPUs per pool group: the allowed CPUs, cut to `threads` (taken round-robin over NUMA nodes so
    /// every node keeps a share), grouped by node (`Auto`) or as one group (`Off`).
    pub fn cpu_groups(&self) -> Result<Vec<Vec<usize>>, OptionsError> {
        Ok(self.plan()?.into_iter().map(|(_, c)| c).collect())
    }

    /// (NUMA node, CPUs) per group.
    fn plan(&self) -> Result<Vec<GroupPlan>, OptionsError> {
        let allowed = allowed_cpus();
        let want = self.threads.unwrap_or(allowed.len());
        if want > allowed.len() {
            // More threads than CPUs would oversubscribe; allow it but unpinned duplicates help no one.
            return Err(OptionsError::Threads(format!(
                "{want} threads requested but this process may use only {} CPUs",
                allowed.len()
            )));
        }
        let nodes = match self.numa {
            NumaMode::Auto => numa_nodes(&allowed),
            NumaMode::Off => vec![super::topology::NumaNode {
                id: 0,
                cpus: allowed.clone(),
            }],
        };
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        let mut taken = 0;
        let mut round = 0;
        while taken < want {
            for (g, n) in nodes.iter().enumerate() {
                if taken < want && round < n.cpus.len() {
                    groups[g].push(n.cpus[round]);
                    taken += 1;
                }
            }
            round += 1;
        }
        let numa = self.numa == NumaMode::Auto && nodes.len() > 1;
        let mut plan: Vec<GroupPlan> = nodes
            .iter()
            .zip(groups)
            .filter(|(_, g)| !g.is_empty())
            .map(|(n, g)| (numa.then_some(n.id), g))
            .collect();
        plan.truncate(MAX_GROUPS);
        Ok(plan)
    }

    /// Builds the persistent worker pool these options describe.
    pub fn build_pool(&self) -> Result<WorkerPool, OptionsError> {
        let plan = self.plan()?;
        let cpus: Vec<Vec<usize>> = plan.iter().map(|(_, c)| c.clone()).collect();
        let nodes = plan.iter().map(|(n, _)| *n).collect();
        Ok(WorkerPool::new(&cpus, self.pin, self.spin).with_group_nodes(nodes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flag_values_and_rejects_bad_ones() {
        assert_eq!("off".parse::<NumaMode>(), Ok(NumaMode::Off));
        assert_eq!("auto".parse::<NumaMode>(), Ok(NumaMode::Auto));
        assert!(matches!(
            "on".parse::<NumaMode>(),
            Err(OptionsError::Numa(_))
        ));
        assert_eq!("2M".parse::<HugepageMode>(), Ok(HugepageMode::Huge));
        assert!("4K".parse::<HugepageMode>().is_err());
        assert!("avx3".parse::<CpuTier>().is_err());
    }

    #[test]
    fn groups_hold_requested_threads() {
        let o = CpuMoeOptions {
            threads: Some(1),
            ..Default::default()
        };
        let g = o.cpu_groups().unwrap();
        assert_eq!(g.iter().map(Vec::len).sum::<usize>(), 1);
        let o = CpuMoeOptions {
            threads: Some(100_000),
            ..Default::default()
        };
        assert!(o.cpu_groups().is_err());
    }
}
