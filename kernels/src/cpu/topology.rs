//! Which CPUs this process may use, how they group into NUMA nodes, and pinning a thread to one.
//!
//! Uses `sched_getaffinity` (inside a Guaranteed Kubernetes pod this is exactly the pod's exclusive
//! cpuset) and Linux sysfs (`/sys/devices/system/node/node*/cpulist`) instead of hwloc: both are always
//! present, need no C library at build or run time, and give the two facts the kernels need.

use std::fs;
use std::sync::OnceLock;

/// A NUMA node and the allowed CPUs on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    pub id: usize,
    pub cpus: Vec<usize>,
}

/// CPUs this process may run on (its cpuset), ascending. Read once, on the first call, and cached:
/// afterwards the calling thread may have been pinned to one CPU (the worker pool pins the thread that
/// drives it), and its own affinity would no longer tell the process's.
pub fn allowed_cpus() -> Vec<usize> {
    static CPUS: OnceLock<Vec<usize>> = OnceLock::new();
    CPUS.get_or_init(read_allowed_cpus).clone()
}

fn read_allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most size_of::<cpu_set_t>() bytes.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect();
                if !cpus.is_empty() {
                    return cpus;
                }
            }
        }
    }
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    (0..n).collect()
}

/// Parses a kernel cpulist such as `0-3,8,10-11`.
pub fn parse_cpulist(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.trim().parse::<usize>().ok()),
        }
    }
    out
}

/// NUMA nodes that hold at least one allowed CPU, each with its allowed CPUs. One node holding every
/// allowed CPU when sysfs has no NUMA information.
pub fn numa_nodes(allowed: &[usize]) -> Vec<NumaNode> {
    let mut nodes = Vec::new();
    if let Ok(dir) = fs::read_dir("/sys/devices/system/node") {
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = name
                .strip_prefix("node")
                .and_then(|s| s.parse::<usize>().ok())
            else {
                continue;
            };
            let Ok(list) = fs::read_to_string(entry.path().join("cpulist")) else {
                continue;
            };
            let cpus: Vec<usize> = parse_cpulist(&list)
                .into_iter()
                .filter(|c| allowed.contains(c))
                .collect();
            if !cpus.is_empty() {
                nodes.push(NumaNode { id, cpus });
            }
        }
    }
    nodes.sort_by_key(|n| n.id);
    if nodes.is_empty() {
        nodes.push(NumaNode {
            id: 0,
            cpus: allowed.to_vec(),
        });
    }
    nodes
}

/// Pins the calling thread to one CPU. Returns false (and leaves the thread as it was) on failure.
pub fn pin_current_thread(cpu: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as in `allowed_cpus`; CPU_SET bounds-checks against CPU_SETSIZE via the assert below.
        unsafe {
            if cpu >= libc::CPU_SETSIZE as usize {
                return false;
            }
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpu;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulist_parsing() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
    }

    #[test]
    fn allowed_cpus_survive_pinning_a_thread() {
        let all = allowed_cpus();
        let cpu = *all.last().unwrap();
        let seen = std::thread::spawn(move || {
            assert!(pin_current_thread(cpu));
            allowed_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(seen, all);
    }

    #[test]
    fn nodes_cover_allowed_cpus() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        let nodes = numa_nodes(&allowed);
        let mut all: Vec<usize> = nodes.iter().flat_map(|n| n.cpus.clone()).collect();
        all.sort();
        assert_eq!(all, allowed);
    }
}
