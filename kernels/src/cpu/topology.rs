//! Which CPUs this process may use, how they group into NUMA nodes, pinning a thread to one CPU and
//! binding memory to one node — through hwloc, with a small Linux fallback.
//!
//! **hwloc** (the C library, 2.x, linked dynamically; bindings: the `hwlocality` crate) is the mechanism.
//! The topology is loaded once per process ([`OnceLock`]) and then only read, which hwloc allows from
//! any thread. From it:
//! - allowed CPUs: the process's CPU binding (`hwloc_get_cpubind(HWLOC_CPUBIND_PROCESS)`, on Linux the
//!   union of its threads' affinities, so a thread the pool has pinned does not shrink it) intersected with
//!   the topology's allowed cpuset (cgroup cpuset). Inside a Guaranteed Kubernetes pod with the static CPU
//!   manager policy both are exactly the pod's exclusive CPUs;
//! - NUMA nodes: hwloc's NUMANode objects (OS index = the kernel's node number), each with the allowed PUs
//!   of its cpuset;
//! - pinning: `hwloc_set_cpubind(HWLOC_CPUBIND_THREAD)` with a one-PU cpuset;
//! - memory: `hwloc_set_area_membind(HWLOC_MEMBIND_BIND)` with a one-node nodeset (see `memory.rs`).
//!
//! Why `hwlocality` and not `hwloc2` (the crate the design doc named): both were built here against
//! Debian bookworm's hwloc 2.9.0. `hwloc2` 2.2.0 (2020) links, but its hand-written enums predate hwloc
//! 2.x's virtual depths: `objects_with_type(NUMANode)` panics ("depth 4294967292 is out of bounds"), so it
//! cannot list NUMA nodes; it also needs `&mut Topology` to bind a CPU (a lock around every pin of a
//! shared topology), has memory binding only as raw FFI, and pulls `num 0.1` and `errno 0.2`.
//! `hwlocality` (1.0.0-alpha.13, MSRV 1.85, maintained against hwloc 2.x) has a `Send + Sync` topology,
//! safe CPU and area-memory binding and typed errors. Default features: the hwloc >= 2.0.4 API, found by
//! pkg-config and linked dynamically (`libhwloc.so.15`; its `vendored` feature, which downloads and builds
//! hwloc, stays off). One wrinkle: `hwlocality-sys` always asks pkg-config with `--static`, which adds
//! hwloc's private libraries (`-lm -ludev -lpthread`) to the link line, so building also needs
//! `libudev-dev` (the `libudev.so` symlink; `--as-needed` drops it, the binary needs only
//! `libhwloc.so.15`). The version is pinned exactly (`=`) because it is a pre-release.
//!
//! **Fallback** (module `fallback`): if hwloc cannot load a topology of this machine at run time, the
//! daemon must still start. Then `sched_getaffinity` gives the allowed CPUs, sysfs
//! (`/sys/devices/system/node/node*/cpulist`) the nodes, `sched_setaffinity` pins and `mbind(MPOL_BIND)`
//! binds. [`topology_source`] says which one is in use (the bench header prints it; the daemon logs a
//! warning on the fallback).
//!
//! A CPU belongs to one node only: hwloc gives memory-only nodes (HBM, CXL) their package's cpuset, so
//! nodes are taken by ascending OS index and a CPU already claimed by a lower node is not repeated (sysfs
//! lists no CPU for such nodes, so both paths agree).

use std::fmt;
use std::sync::OnceLock;

use hwlocality::cpu::binding::CpuBindingFlags;
use hwlocality::cpu::cpuset::CpuSet;
use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
use hwlocality::memory::nodeset::NodeSet;
use hwlocality::object::types::ObjectType;
use hwlocality::Topology;

/// A NUMA node and the allowed CPUs on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    pub id: usize,
    pub cpus: Vec<usize>,
}

/// Which mechanism answers topology questions and does the binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopologySource {
    /// hwloc, with the library's version (from the topology's root object).
    Hwloc { version: String },
    /// hwloc could not load a topology of this machine; `sched_*affinity`, sysfs and `mbind` instead.
    Fallback { reason: String },
}

impl fmt::Display for TopologySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopologySource::Hwloc { version } => write!(f, "hwloc {version}"),
            TopologySource::Fallback { reason } => write!(
                f,
                "sched_getaffinity + sysfs + mbind fallback (hwloc unavailable: {reason})"
            ),
        }
    }
}

/// The loaded hwloc topology and the facts read from it once.
struct Hwloc {
    topology: Topology,
    version: String,
    allowed: Vec<usize>,
    /// Every NUMA node with at least one allowed CPU, ascending id, CPUs disjoint.
    nodes: Vec<NumaNode>,
}

enum Backend {
    Hwloc(Hwloc),
    Fallback { reason: String, allowed: Vec<usize> },
}

/// Loaded on the first call, before the pool pins any thread (the fallback reads the calling thread's
/// affinity, which must still be the process's).
fn backend() -> &'static Backend {
    static BACKEND: OnceLock<Backend> = OnceLock::new();
    BACKEND.get_or_init(|| match Hwloc::load() {
        Ok(h) => Backend::Hwloc(h),
        Err(reason) => Backend::Fallback {
            reason,
            allowed: fallback::read_allowed_cpus(),
        },
    })
}

impl Hwloc {
    fn load() -> Result<Hwloc, String> {
        let topology = Topology::new().map_err(|e| format!("loading the topology failed: {e}"))?;
        if !topology.is_this_system() {
            return Err(
                "the loaded topology is not this machine's (HWLOC_XMLFILE or HWLOC_SYNTHETIC set?)"
                    .into(),
            );
        }
        let binding = topology
            .cpu_binding(CpuBindingFlags::PROCESS)
            .map_err(|e| format!("reading the process CPU binding failed: {e}"))?;
        let permitted = topology.allowed_cpuset();
        let allowed: Vec<usize> = binding
            .iter_set()
            .filter(|&pu| permitted.is_set(pu))
            .map(usize::from)
            .collect();
        if allowed.is_empty() {
            return Err("no CPU is both bound to this process and allowed by hwloc".into());
        }
        let mut all: Vec<NumaNode> = topology
            .objects_with_type(ObjectType::NUMANode)
            .filter_map(|n| {
                Some(NumaNode {
                    id: n.os_index()?,
                    cpus: n.cpuset()?.iter_set().map(usize::from).collect(),
                })
            })
            .collect();
        all.sort_by_key(|n| n.id);
        let nodes = disjoint_nodes(all, &allowed);
        let version = topology
            .root_object()
            .info("hwlocVersion")
            .map(|v| v.to_string_lossy().into_owned())
            .unwrap_or_else(|| format!("(API {:#x})", hwlocality::hwloc_api_version()));
        Ok(Hwloc {
            topology,
            version,
            allowed,
            nodes,
        })
    }
}

/// Keeps the allowed CPUs of each node (sorted by id), each CPU only in the first node holding it, and
/// drops nodes left without CPUs.
fn disjoint_nodes(nodes: Vec<NumaNode>, allowed: &[usize]) -> Vec<NumaNode> {
    let mut claimed: Vec<usize> = Vec::new();
    let mut out = Vec::new();
    for n in nodes {
        let cpus: Vec<usize> = n
            .cpus
            .into_iter()
            .filter(|c| allowed.contains(c) && !claimed.contains(c))
            .collect();
        if !cpus.is_empty() {
            claimed.extend(&cpus);
            out.push(NumaNode { id: n.id, cpus });
        }
    }
    out
}

/// Which mechanism is in use (loads the topology if it was not yet).
pub fn topology_source() -> TopologySource {
    match backend() {
        Backend::Hwloc(h) => TopologySource::Hwloc {
            version: h.version.clone(),
        },
        Backend::Fallback { reason, .. } => TopologySource::Fallback {
            reason: reason.clone(),
        },
    }
}

/// CPUs this process may run on (its cpuset), ascending. Read once, on the first call, and cached.
pub fn allowed_cpus() -> Vec<usize> {
    match backend() {
        Backend::Hwloc(h) => h.allowed.clone(),
        Backend::Fallback { allowed, .. } => allowed.clone(),
    }
}

/// NUMA nodes that hold at least one of `allowed`, each with those of its CPUs, ascending id, every CPU
/// in one node. One node (id 0) holding every allowed CPU when there is no NUMA information.
pub fn numa_nodes(allowed: &[usize]) -> Vec<NumaNode> {
    let mut nodes = match backend() {
        Backend::Hwloc(h) => disjoint_nodes(h.nodes.clone(), allowed),
        Backend::Fallback { .. } => fallback::numa_nodes(allowed),
    };
    if nodes.is_empty() {
        nodes.push(NumaNode {
            id: 0,
            cpus: allowed.to_vec(),
        });
    }
    nodes
}

/// Pins the calling thread to one CPU. Returns false (and leaves the thread as it was) on failure,
/// including a CPU this process may not use.
pub fn pin_current_thread(cpu: usize) -> bool {
    match backend() {
        Backend::Hwloc(h) => {
            let Ok(idx) = hwlocality::bitmap::BitmapIndex::try_from(cpu) else {
                return false;
            };
            let mut set = CpuSet::new();
            set.set(idx);
            h.topology.bind_cpu(&set, CpuBindingFlags::THREAD).is_ok()
        }
        Backend::Fallback { .. } => fallback::pin_current_thread(cpu),
    }
}

/// A thread's CPU affinity as it was before something pinned it, so that it can be given back. The
/// pool pins each new calling thread to the caller's CPU; without giving the previous caller its own
/// affinity back, every thread that ever opened a region (a rayon thread of one prefill, say) stayed
/// on that one CPU beside the decode thread, and the kernel switched them in and out there (5–6
/// involuntary switches per decode layer call measured on the H200 host, docs/PERF.md).
#[derive(Clone, Copy)]
pub struct SavedAffinity {
    #[cfg(target_os = "linux")]
    tid: libc::pid_t,
    #[cfg(target_os = "linux")]
    set: libc::cpu_set_t,
}

impl SavedAffinity {
    /// The calling thread's affinity now; `None` where the system does not say (non-Linux).
    pub fn of_current_thread() -> Option<SavedAffinity> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: gettid has no preconditions; cpu_set_t is plain data and sched_getaffinity
            // writes at most size_of::<cpu_set_t>() bytes into it.
            unsafe {
                let tid = libc::gettid();
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                (libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set)
                    == 0)
                    .then_some(SavedAffinity { tid, set })
            }
        }
        #[cfg(not(target_os = "linux"))]
        None
    }

    /// Gives the saved thread its saved affinity back (from any thread of this process). False when
    /// that thread has exited (its id is checked against this process's tasks first, so a reused id
    /// of another process's thread is never touched) or the system refuses.
    pub fn restore(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            if !std::path::Path::new(&format!("/proc/self/task/{}", self.tid)).exists() {
                return false;
            }
            // SAFETY: plain-data cpu_set_t read by the kernel; a stale id fails with ESRCH.
            unsafe {
                libc::sched_setaffinity(self.tid, std::mem::size_of::<libc::cpu_set_t>(), &self.set)
                    == 0
            }
        }
        #[cfg(not(target_os = "linux"))]
        false
    }

    /// CPUs in the saved set.
    pub fn cpus(&self) -> Vec<usize> {
        #[cfg(target_os = "linux")]
        {
            (0..libc::CPU_SETSIZE as usize)
                // SAFETY: index below CPU_SETSIZE.
                .filter(|&c| unsafe { libc::CPU_ISSET(c, &self.set) })
                .collect()
        }
        #[cfg(not(target_os = "linux"))]
        Vec::new()
    }
}

/// Binds the pages of `[ptr, ptr + len)` to NUMA node `node` (BIND policy: allocate there, no other
/// node), before first touch. Best effort: returns false where the system refuses (single-node kernels
/// without NUMA support, containers whose seccomp profile denies `mbind` without `CAP_SYS_NICE`), and
/// placement is then first touch, which the repack done by the node's own threads gives too.
///
/// # Safety
/// `[ptr, ptr + len)` must be one live mapping owned by the caller, with no `&mut` to it alive during
/// the call (its bytes are not read or written).
pub unsafe fn bind_area_to_node(ptr: *mut u8, len: usize, node: usize) -> bool {
    if len == 0 {
        return false;
    }
    match backend() {
        Backend::Hwloc(h) => {
            let Ok(idx) = hwlocality::bitmap::BitmapIndex::try_from(node) else {
                return false;
            };
            let mut set = NodeSet::new();
            set.set(idx);
            // SAFETY (caller): a live mapping of `len` bytes; hwloc only passes its range to mbind.
            let area = unsafe { std::slice::from_raw_parts(ptr.cast_const(), len) };
            h.topology
                .bind_memory_area(
                    area,
                    &set,
                    MemoryBindingPolicy::Bind,
                    MemoryBindingFlags::empty(),
                )
                .is_ok()
        }
        // SAFETY (caller): as above.
        Backend::Fallback { .. } => unsafe { fallback::mbind(ptr, len, node) },
    }
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

/// Formats ascending CPUs as a kernel cpulist (`0-3,8`), the inverse of [`parse_cpulist`].
pub fn format_cpulist(cpus: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", cpus[i], cpus[j])
        } else {
            cpus[i].to_string()
        });
        i = j + 1;
    }
    out.join(",")
}

/// The pre-hwloc mechanism, used only when hwloc cannot load a topology: `sched_getaffinity` for the
/// allowed CPUs, sysfs for the nodes, `sched_setaffinity` to pin, `mbind(MPOL_BIND)` for memory.
mod fallback {
    use super::{parse_cpulist, NumaNode};
    use std::fs;

    /// The calling thread's affinity (the process's, as long as nothing pinned this thread yet).
    pub(super) fn read_allowed_cpus() -> Vec<usize> {
        if let Some(cpus) = super::SavedAffinity::of_current_thread()
            .map(|a| a.cpus())
            .filter(|c| !c.is_empty())
        {
            return cpus;
        }
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        (0..n).collect()
    }

    /// Nodes from `/sys/devices/system/node/node*/cpulist` holding an allowed CPU; empty without sysfs.
    pub(super) fn numa_nodes(allowed: &[usize]) -> Vec<NumaNode> {
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
                nodes.push(NumaNode {
                    id,
                    cpus: parse_cpulist(&list),
                });
            }
        }
        nodes.sort_by_key(|n| n.id);
        super::disjoint_nodes(nodes, allowed)
    }

    pub(super) fn pin_current_thread(cpu: usize) -> bool {
        #[cfg(target_os = "linux")]
        {
            if cpu >= libc::CPU_SETSIZE as usize {
                return false;
            }
            // SAFETY: plain-data cpu_set_t, CPU index bounds-checked above.
            unsafe {
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

    /// # Safety
    /// As [`super::bind_area_to_node`].
    pub(super) unsafe fn mbind(ptr: *mut u8, len: usize, node: usize) -> bool {
        #[cfg(target_os = "linux")]
        {
            const MPOL_BIND: libc::c_long = 2;
            if node >= 64 {
                return false;
            }
            let mask: u64 = 1 << node;
            // SAFETY: mbind on the caller's mapping with a one-word node mask (maxnode 65: 64 bits).
            unsafe {
                libc::syscall(
                    libc::SYS_mbind,
                    ptr,
                    len,
                    MPOL_BIND,
                    &mask as *const u64,
                    65usize,
                    0usize,
                ) == 0
            }
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (ptr, len, node);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's affinity, read with the raw syscall (independent of hwloc).
    fn sched_affinity() -> Vec<usize> {
        // SAFETY: plain-data cpu_set_t, written by the kernel.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect()
        }
    }

    #[test]
    fn cpulist_parsing_and_formatting() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpulist(&[5]), "5");
        assert_eq!(format_cpulist(&[]), "");
    }

    #[test]
    fn hwloc_is_the_mechanism_here() {
        // The build and CI machines have libhwloc; a fallback here means the integration broke.
        let src = topology_source();
        assert!(matches!(src, TopologySource::Hwloc { .. }), "{src}");
        assert!(src.to_string().starts_with("hwloc 2."), "{src}");
    }

    #[test]
    fn allowed_cpus_equal_sched_getaffinity() {
        // A fresh test thread inherits the process's affinity; nothing pinned it.
        let allowed = allowed_cpus();
        assert_eq!(allowed, sched_affinity());
        assert_eq!(allowed, fallback::read_allowed_cpus());
    }

    /// The calling thread's or process's CPU binding as hwloc reports it.
    fn hwloc_binding(flags: CpuBindingFlags) -> Vec<usize> {
        let Backend::Hwloc(h) = backend() else {
            panic!("hwloc backend expected");
        };
        h.topology
            .cpu_binding(flags)
            .unwrap()
            .iter_set()
            .map(usize::from)
            .collect()
    }

    #[test]
    fn allowed_cpus_survive_pinning_a_thread() {
        let all = allowed_cpus();
        let cpu = *all.last().unwrap();
        let (seen, process) = std::thread::spawn(move || {
            assert!(pin_current_thread(cpu));
            // Read again now: the process binding is the union over threads, this one pinned or not.
            (allowed_cpus(), hwloc_binding(CpuBindingFlags::PROCESS))
        })
        .join()
        .unwrap();
        assert_eq!(seen, all);
        assert_eq!(process, all);
    }

    #[test]
    fn pinning_a_thread_sets_exactly_that_cpu() {
        for cpu in allowed_cpus() {
            let (after, hwloc_view) = std::thread::spawn(move || {
                assert!(pin_current_thread(cpu), "pinning to CPU {cpu}");
                (sched_affinity(), hwloc_binding(CpuBindingFlags::THREAD))
            })
            .join()
            .unwrap();
            assert_eq!(after, vec![cpu]);
            assert_eq!(hwloc_view, vec![cpu]);
        }
        assert!(!pin_current_thread(usize::MAX));
        assert!(!pin_current_thread(1 << 20)); // not a CPU of this machine
    }

    #[test]
    fn nodes_cover_allowed_cpus() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        let nodes = numa_nodes(&allowed);
        assert!(!nodes.is_empty());
        let mut all: Vec<usize> = nodes.iter().flat_map(|n| n.cpus.clone()).collect();
        all.sort();
        assert_eq!(all, allowed); // covering, and disjoint
                                  // hwloc and sysfs agree on the grouping.
        assert_eq!(nodes, {
            let f = fallback::numa_nodes(&allowed);
            if f.is_empty() {
                vec![NumaNode {
                    id: 0,
                    cpus: allowed.clone(),
                }]
            } else {
                f
            }
        });
    }

    #[test]
    fn memory_only_nodes_do_not_repeat_cpus() {
        let nodes = vec![
            NumaNode {
                id: 0,
                cpus: vec![0, 1, 2, 3],
            },
            NumaNode {
                id: 1,
                cpus: vec![4, 5, 6, 7],
            },
            // HBM of package 0: hwloc gives it the package's cpuset.
            NumaNode {
                id: 2,
                cpus: vec![0, 1, 2, 3],
            },
        ];
        let d = disjoint_nodes(nodes, &[1, 2, 5]);
        assert_eq!(
            d,
            vec![
                NumaNode {
                    id: 0,
                    cpus: vec![1, 2]
                },
                NumaNode {
                    id: 1,
                    cpus: vec![5]
                }
            ]
        );
    }
}
