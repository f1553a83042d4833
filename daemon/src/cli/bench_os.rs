//! What the OS did to this process over a span of `bench decode --cpu-replay` (`bench_replay`):
//! involuntary context switches of its threads (`/proc/self/task/*/status`) and interrupts per CPU
//! (`/proc/interrupts`).

/// What the OS did to the process over a span: involuntary context switches of its pool threads,
/// interrupts on all CPUs and on the busiest one (`None` where /proc does not say).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct OsNoise {
    pub switches: Option<u64>,
    /// The thread (any of the process's) switched most: `name (CPUs …)` and its count.
    pub most_switched: Option<(String, u64)>,
    pub irqs: Option<u64>,
    pub busiest: Option<(usize, u64)>,
}

/// One thread's involuntary context switches so far.
#[derive(Clone, Debug, PartialEq)]
struct ThreadSwitches {
    tid: u64,
    /// `name (CPUs list)`: the pools share the name prefix; the CPUs tell a pinned worker from the
    /// engine's threads.
    label: String,
    pool: bool,
    switches: u64,
}

/// The counters `OsNoise` is the difference of.
pub(super) struct OsCounters {
    threads: Option<Vec<ThreadSwitches>>,
    irqs_per_cpu: Option<Vec<u64>>,
}

impl OsCounters {
    pub(super) fn now() -> Self {
        OsCounters {
            threads: thread_switches(),
            irqs_per_cpu: std::fs::read_to_string("/proc/interrupts")
                .ok()
                .map(|t| irqs_per_cpu(&t)),
        }
    }

    pub(super) fn since(&self, earlier: &OsCounters) -> OsNoise {
        let deltas: Option<Vec<(&ThreadSwitches, u64)>> = match (&self.threads, &earlier.threads) {
            (Some(now), Some(then)) => Some(
                now.iter()
                    .map(|t| {
                        let before = then
                            .iter()
                            .find(|b| b.tid == t.tid)
                            .map_or(0, |b| b.switches);
                        (t, t.switches.saturating_sub(before))
                    })
                    .collect(),
            ),
            _ => None,
        };
        let switches = deltas
            .as_ref()
            .map(|d| d.iter().filter(|(t, _)| t.pool).map(|(_, n)| n).sum());
        let most_switched = deltas.as_ref().and_then(|d| {
            d.iter()
                .max_by_key(|(_, n)| *n)
                .filter(|(_, n)| *n > 0)
                .map(|(t, n)| (t.label.clone(), *n))
        });
        let per_cpu: Option<Vec<u64>> = match (&self.irqs_per_cpu, &earlier.irqs_per_cpu) {
            (Some(a), Some(b)) if a.len() == b.len() => {
                Some(a.iter().zip(b).map(|(x, y)| x.saturating_sub(*y)).collect())
            }
            _ => None,
        };
        OsNoise {
            switches,
            most_switched,
            irqs: per_cpu.as_ref().map(|v| v.iter().sum()),
            busiest: per_cpu.and_then(|v| v.iter().copied().enumerate().max_by_key(|&(_, n)| n)),
        }
    }
}

/// Involuntary context switches of each of this process's threads; `pool` marks those named
/// `moe-cpu-*` (the expert pool's workers and the engine's rayon threads, which run the GPU step).
fn thread_switches() -> Option<Vec<ThreadSwitches>> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or("?")
            .trim();
        out.push(ThreadSwitches {
            tid,
            label: format!("{} (CPUs {cpus})", comm.trim()),
            pool: comm.starts_with("moe-cpu-"),
            switches: nonvoluntary_switches(&status).unwrap_or(0),
        });
    }
    Some(out)
}

/// `nonvoluntary_ctxt_switches` of a `/proc/.../status` text.
fn nonvoluntary_switches(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Interrupts per CPU summed over the lines of a `/proc/interrupts` text (its header names the CPUs;
/// each line's first that many numbers are per CPU).
fn irqs_per_cpu(text: &str) -> Vec<u64> {
    let mut lines = text.lines();
    let cpus = lines.next().map_or(0, |h| h.split_whitespace().count());
    let mut sum = vec![0u64; cpus];
    for l in lines {
        let Some((_, rest)) = l.split_once(':') else {
            continue;
        };
        for (s, v) in sum.iter_mut().zip(rest.split_whitespace()) {
            match v.parse::<u64>() {
                Ok(n) => *s += n,
                Err(_) => break, // the line's description (or a line without per-CPU counts)
            }
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_counters_parse() {
        let status =
            "Name:\tmoe-cpu-3\nvoluntary_ctxt_switches:\t10\nnonvoluntary_ctxt_switches:\t7\n";
        assert_eq!(nonvoluntary_switches(status), Some(7));
        assert_eq!(nonvoluntary_switches("Name: x\n"), None);
        let irqs = "           CPU0       CPU1\n  0:         40          0   IO-APIC    2-edge      timer\nLOC:       1000       2000   Local timer interrupts\nERR:          0\n";
        assert_eq!(irqs_per_cpu(irqs), vec![1040, 2000]);
        let th = |tid, pool, switches| ThreadSwitches {
            tid,
            label: format!("t{tid}"),
            pool,
            switches,
        };
        let a = OsCounters {
            threads: Some(vec![th(1, true, 10), th(2, false, 30), th(3, true, 4)]),
            irqs_per_cpu: Some(vec![5, 9]),
        };
        let b = OsCounters {
            threads: Some(vec![th(1, true, 4), th(2, false, 20)]),
            irqs_per_cpu: Some(vec![1, 2]),
        };
        let n = a.since(&b);
        // pool threads: 6 + 4 (a thread new since `b` counts from 0); the most switched is any thread
        assert_eq!(
            (n.switches, n.irqs, n.busiest),
            (Some(10), Some(11), Some((1, 7)))
        );
        assert_eq!(n.most_switched, Some(("t2".to_string(), 10)));
        let mine = thread_switches().expect("/proc/self/task");
        assert!(!mine.is_empty() && mine.iter().all(|t| t.label.contains("(CPUs ")));
    }
}
