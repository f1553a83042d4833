//! Expert weight memory: one zero-filled mapping per allocation, 64-byte aligned (page aligned in fact),
//! on explicit hugepages when reserved, else transparent hugepages, else plain pages; optionally bound
//! to one NUMA node (through hwloc, see [`topology`](super::topology)).
//!
//! Why: a decode token streams ~75 MB of scattered experts per layer; 4 KiB pages would cost a TLB miss
//! every 4 KiB. 1 GiB pages are used only when the rounding waste stays under 1/8 of the request.

use std::fmt;
use std::str::FromStr;

use super::topology;

/// What the caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HugepageMode {
    /// 1 GiB pages if reserved and the waste is small, else 2 MiB, else THP, else plain.
    #[default]
    Auto,
    /// Reserved 1 GiB pages, else fall back like `Auto` below 1 GiB.
    Giant,
    /// Reserved 2 MiB pages, else THP.
    Huge,
    /// Plain pages, no madvise.
    Off,
}

impl FromStr for HugepageMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(HugepageMode::Auto),
            "1G" | "1g" => Ok(HugepageMode::Giant),
            "2M" | "2m" => Ok(HugepageMode::Huge),
            "off" => Ok(HugepageMode::Off),
            _ => Err(format!(
                "invalid hugepages mode {s:?} (expected auto|1G|2M|off)"
            )),
        }
    }
}

/// What an allocation actually got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PageKind {
    Plain,
    /// Transparent hugepages requested with madvise(MADV_HUGEPAGE); the kernel may still use 4 KiB.
    Transparent,
    Huge2M,
    Huge1G,
}

impl fmt::Display for PageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageKind::Plain => "4K pages",
            PageKind::Transparent => "THP (madvise)",
            PageKind::Huge2M => "2M hugetlb",
            PageKind::Huge1G => "1G hugetlb",
        })
    }
}

/// An anonymous zero-filled mapping. Dereferences to bytes.
pub struct HugeBuffer {
    ptr: *mut u8,
    len: usize,
    map_len: usize,
    kind: PageKind,
    /// NUMA node the pages are bound to, when binding was asked for and succeeded.
    node: Option<usize>,
}

// SAFETY: owns its mapping exclusively, like a Box<[u8]>.
unsafe impl Send for HugeBuffer {}
unsafe impl Sync for HugeBuffer {}

const MB2: usize = 2 << 20;
const GB1: usize = 1 << 30;

impl HugeBuffer {
    /// Maps `len` bytes (at least 1) following `mode`; `numa_node` binds the pages to that node before
    /// first touch (hwloc `set_area_membind` with the BIND policy, or `mbind` on the fallback path; best
    /// effort, see [`topology::bind_area_to_node`]; [`numa_node`](Self::numa_node) tells). Falls back
    /// down the list rather than failing; panics only if even plain anonymous memory cannot be mapped
    /// (out of memory).
    pub fn new(len: usize, mode: HugepageMode, numa_node: Option<usize>) -> HugeBuffer {
        let len = len.max(1);
        let try_1g = match mode {
            HugepageMode::Giant => true,
            HugepageMode::Auto => len.div_ceil(GB1) * GB1 - len <= len / 8,
            _ => false,
        };
        let try_2m = matches!(
            mode,
            HugepageMode::Auto | HugepageMode::Giant | HugepageMode::Huge
        );
        let mut attempts = Vec::new();
        if try_1g {
            attempts.push((PageKind::Huge1G, GB1));
        }
        if try_2m {
            attempts.push((PageKind::Huge2M, MB2));
        }
        for (kind, page) in attempts {
            if let Some(b) = map(len, page, kind, numa_node) {
                return b;
            }
        }
        let kind = if mode == HugepageMode::Off {
            PageKind::Plain
        } else {
            PageKind::Transparent
        };
        map(len, 4096, kind, numa_node).expect("out of memory mapping expert weights")
    }

    pub fn kind(&self) -> PageKind {
        self.kind
    }

    /// The NUMA node the pages are bound to; `None` if none was asked for or the system refused
    /// (placement is then first touch).
    pub fn numa_node(&self) -> Option<usize> {
        self.node
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

fn map(len: usize, page: usize, kind: PageKind, node: Option<usize>) -> Option<HugeBuffer> {
    let map_len = len.div_ceil(page) * page;
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    match kind {
        PageKind::Huge1G => flags |= libc::MAP_HUGETLB | libc::MAP_HUGE_1GB,
        PageKind::Huge2M => flags |= libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
        _ => {}
    }
    // SAFETY: anonymous mapping, no file, result checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    if kind == PageKind::Transparent {
        // SAFETY: advice on our own fresh mapping; failure only means no THP.
        unsafe { libc::madvise(p, map_len, libc::MADV_HUGEPAGE) };
    }
    // SAFETY: our own fresh mapping of map_len bytes, not yet referenced anywhere else.
    let node = node.filter(|&n| unsafe { topology::bind_area_to_node(p.cast(), map_len, n) });
    Some(HugeBuffer {
        ptr: p.cast(),
        len,
        map_len,
        kind,
        node,
    })
}

impl std::ops::Deref for HugeBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: mapping of at least len bytes, alive while self is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for HugeBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold it exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HugeBuffer {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping exactly once.
        unsafe { libc::munmap(self.ptr.cast(), self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_zeroed_aligned_memory_in_every_mode() {
        for mode in ["auto", "1G", "2M", "off"] {
            let mode: HugepageMode = mode.parse().unwrap();
            let mut b = HugeBuffer::new(3 << 20, mode, None);
            assert_eq!(b.as_ptr() as usize % 64, 0);
            assert!(b.iter().all(|&x| x == 0));
            b[12345] = 7;
            assert_eq!(b[12345], 7);
            if mode == HugepageMode::Off {
                assert_eq!(b.kind(), PageKind::Plain);
            }
        }
        assert!("3M".parse::<HugepageMode>().is_err());
    }

    #[test]
    fn buffer_bound_to_node_0_works() {
        use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
        use hwlocality::memory::nodeset::NodeSet;
        let node = topology::numa_nodes(&topology::allowed_cpus())[0].id;
        assert_eq!(node, 0, "this test expects node 0 on the build machine");
        for mode in [HugepageMode::Off, HugepageMode::Auto] {
            let mut b = HugeBuffer::new(3 << 20, mode, Some(node));
            assert_eq!(b.numa_node(), Some(node), "binding refused ({mode:?})");
            // hwloc reads the policy back from the kernel (get_mempolicy per page).
            let topo = hwlocality::Topology::new().unwrap();
            let (set, policy) = topo
                .area_memory_binding::<[u8], NodeSet>(&b[..], MemoryBindingFlags::empty())
                .unwrap();
            assert_eq!(policy, Some(MemoryBindingPolicy::Bind));
            assert_eq!(set.iter_set().map(usize::from).collect::<Vec<_>>(), [node]);
            assert!(b.iter().all(|&x| x == 0));
            b.iter_mut().step_by(4096).for_each(|x| *x = 3);
            assert_eq!(b[8192], 3);
        }
        assert_eq!(
            HugeBuffer::new(4096, HugepageMode::Off, None).numa_node(),
            None
        );
    }
}
