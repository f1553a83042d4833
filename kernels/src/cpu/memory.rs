//! Expert weight memory: one zero-filled mapping per allocation, 64-byte aligned (page aligned in fact),
//! on explicit hugepages when reserved, else transparent hugepages, else plain pages; optionally bound
//! to one NUMA node (through hwloc, see [`topology`](super::topology)).
//!
//! Why: a decode token streams ~75 MB of scattered experts per layer; 4 KiB pages would cost a TLB miss
//! every 4 KiB. 1 GiB pages are used only when the rounding waste stays under 1/8 of the request.

use std::fmt;
use std::str::FromStr;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::backing::{self, PageBacking};
use super::pool::WorkerPool;
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
    /// Transparent hugepages only, even where pages are reserved.
    Transparent,
    /// 4 KiB pages (advised `MADV_NOHUGEPAGE`, so THP set to `always` does not apply either).
    Off,
}

impl FromStr for HugepageMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(HugepageMode::Auto),
            "1G" | "1g" => Ok(HugepageMode::Giant),
            "2M" | "2m" => Ok(HugepageMode::Huge),
            "thp" => Ok(HugepageMode::Transparent),
            "off" => Ok(HugepageMode::Off),
            _ => Err(format!(
                "invalid hugepages mode {s:?} (expected auto|1G|2M|thp|off)"
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
    /// The usable mapping: `len` rounded up to the page size (2 MiB for THP).
    map_len: usize,
    /// What `Drop` unmaps: the usable mapping and its guard pages.
    reserve: (*mut u8, usize),
    kind: PageKind,
    /// NUMA node the pages are bound to, when binding was asked for and succeeded.
    node: Option<usize>,
}

// SAFETY: owns its mapping exclusively, like a Box<[u8]>.
unsafe impl Send for HugeBuffer {}
unsafe impl Sync for HugeBuffer {}

const PAGE: usize = 4096;
const MB2: usize = 2 << 20;
const GB1: usize = 1 << 30;

impl HugeBuffer {
    /// Maps `len` bytes (at least 1) following `mode`; `numa_node` binds the pages to that node before
    /// first touch (hwloc `set_area_membind` with the BIND policy, or `mbind` on the fallback path; best
    /// effort, see [`topology::bind_area_to_node`]; [`numa_node`](Self::numa_node) tells). Falls back
    /// down the list rather than failing; panics only if even plain anonymous memory cannot be mapped
    /// (out of memory).
    pub fn new(len: usize, mode: HugepageMode, numa_node: Option<usize>) -> HugeBuffer {
        // Each kind of page is tried only where the system allows it: reserved pages must be free
        // in the pool (and under the cgroup's hugetlb limit); THP may still give 4 KiB pages, which
        // [`backing_of`] tells and [`collapse_to_huge_pages`] mends.
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

    /// Start and length of the mapping (`len` rounded up to its page size), for
    /// [`backing::read_backing`].
    pub fn mapped_range(&self) -> (usize, usize) {
        (self.ptr as usize, self.map_len)
    }
}

/// What backs `buffers` now (reads `/proc/self/smaps` once; see [`backing`] for the cost).
pub fn backing_of<'a>(
    buffers: impl IntoIterator<Item = &'a HugeBuffer>,
) -> std::io::Result<PageBacking> {
    let ranges: Vec<(usize, usize)> = buffers.into_iter().map(|b| b.mapped_range()).collect();
    backing::read_backing(&ranges)
}

/// What [`collapse_to_huge_pages`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CollapseReport {
    /// 2 MiB ranges of THP buffers asked about.
    pub ranges: usize,
    /// Ranges the kernel could not put on a huge page (none free after compaction, or busy).
    pub failed: usize,
    /// Ranges not tried: the kernel has no `MADV_COLLAPSE` (before Linux 6.1) or too many failed.
    pub skipped: usize,
    /// The kernel refused `MADV_COLLAPSE` itself.
    pub unsupported: bool,
    pub seconds: f64,
}

/// Consecutive-or-not allocation failures after which the rest is left to khugepaged: each failure
/// has already paid for a direct compaction that found no free 2 MiB.
const COLLAPSE_MAX_FAILURES: usize = 64;

/// Puts every 2 MiB of the THP buffers among `buffers` on a transparent huge page now
/// (`madvise(MADV_COLLAPSE)`, Linux 6.1+), on the pool's threads. THP faults give 4 KiB pages where no
/// free huge page was at hand (fragmented memory, page cache), and khugepaged fixes that only slowly
/// (minutes for tens of GB); this collapse copies those pages into huge pages at load. Ranges already on
/// a huge page cost a page-table look-up; a 4 KiB range costs allocating (compacting if needed) and
/// copying 2 MiB. Buffers on reserved pages or plain pages (`--hugepages off`) are left alone.
pub fn collapse_to_huge_pages(buffers: &[&HugeBuffer], pool: &WorkerPool) -> CollapseReport {
    let t = std::time::Instant::now();
    let groups = pool.groups();
    let mut lists: Vec<Vec<usize>> = vec![Vec::new(); groups];
    for (i, b) in buffers.iter().enumerate() {
        if b.kind == PageKind::Transparent {
            let start = b.ptr as usize;
            lists[i % groups].extend((0..b.map_len / MB2).map(|k| start + k * MB2));
        }
    }
    let ranges = lists.iter().map(Vec::len).sum();
    if ranges == 0 {
        return CollapseReport::default();
    }
    let failed = AtomicUsize::new(0);
    let skipped = AtomicUsize::new(0);
    let unsupported = AtomicBool::new(false);
    let items: Vec<usize> = lists.iter().map(Vec::len).collect();
    pool.run(&items, &|g, item, _| {
        if unsupported.load(Ordering::Relaxed)
            || failed.load(Ordering::Relaxed) >= COLLAPSE_MAX_FAILURES
        {
            skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // SAFETY: a 2 MiB-aligned range inside a live THP buffer (alive for this call); the advice
        // changes which pages back it, never its contents.
        let rc = unsafe { libc::madvise(lists[g][item] as *mut libc::c_void, MB2, MADV_COLLAPSE) };
        if rc != 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINVAL) => unsupported.store(true, Ordering::Relaxed),
                _ => {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    let unsupported = unsupported.into_inner();
    let failed = failed.into_inner();
    let skipped = skipped.into_inner();
    CollapseReport {
        ranges,
        // with no MADV_COLLAPSE, the calls that said so count as not tried
        failed: if unsupported { 0 } else { failed },
        skipped: if unsupported { ranges } else { skipped },
        unsupported,
        seconds: t.elapsed().as_secs_f64(),
    }
}

/// `madvise` advice of Linux 6.1+ (not in every libc target's constants).
const MADV_COLLAPSE: libc::c_int = 25;

fn map(len: usize, page: usize, kind: PageKind, node: Option<usize>) -> Option<HugeBuffer> {
    if matches!(kind, PageKind::Huge1G | PageKind::Huge2M) {
        return map_hugetlb(len, page, kind, node);
    }
    // THP: start on a 2 MiB boundary and cover whole 2 MiB, so every byte can sit in a huge page.
    let align = if kind == PageKind::Transparent {
        MB2
    } else {
        PAGE
    };
    let map_len = len.div_ceil(align) * align;
    // A PROT_NONE reservation with the usable range inside it, at least a page of guard on each side:
    // the guards keep the range in a VMA of its own (the kernel merges neighbouring anonymous
    // mappings), so smaps reports exactly this buffer's backing.
    let reserve_len = map_len + align + 2 * PAGE;
    // SAFETY: anonymous reservation, no file, result checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let start = (base as usize + PAGE).next_multiple_of(align);
    let p = start as *mut libc::c_void;
    // SAFETY: [start, start + map_len) lies inside the reservation (start ≤ base + align, and
    // reserve_len leaves a page after it); it becomes readable and writable, zero-filled on first touch.
    if unsafe { libc::mprotect(p, map_len, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
        // SAFETY: our own reservation, unmapped once.
        unsafe { libc::munmap(base, reserve_len) };
        return None;
    }
    // THP asked for before the first touch; plain pages kept plain even where THP is `always`
    let advice = if kind == PageKind::Transparent {
        libc::MADV_HUGEPAGE
    } else {
        libc::MADV_NOHUGEPAGE
    };
    // SAFETY: advice on our own fresh mapping before its first touch; failure only changes page sizes.
    unsafe { libc::madvise(p, map_len, advice) };
    // SAFETY: our own fresh mapping of map_len bytes, not yet referenced anywhere else.
    let node = node.filter(|&n| unsafe { topology::bind_area_to_node(p.cast(), map_len, n) });
    Some(HugeBuffer {
        ptr: p.cast(),
        len,
        map_len,
        reserve: (base.cast(), reserve_len),
        kind,
        node,
    })
}

/// Reserved hugepages (hugetlb): the kernel reserves the whole mapping from the pool at `mmap` or
/// refuses it, and hugetlb mappings never merge with their neighbours.
fn map_hugetlb(len: usize, page: usize, kind: PageKind, node: Option<usize>) -> Option<HugeBuffer> {
    let map_len = len.div_ceil(page) * page;
    if !cgroup::hugetlb_room(page, map_len as u64) {
        return None;
    }
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB;
    flags |= if kind == PageKind::Huge1G {
        libc::MAP_HUGE_1GB
    } else {
        libc::MAP_HUGE_2MB
    };
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
    // SAFETY: our own fresh mapping of map_len bytes, not yet referenced anywhere else.
    let node = node.filter(|&n| unsafe { topology::bind_area_to_node(p.cast(), map_len, n) });
    Some(HugeBuffer {
        ptr: p.cast(),
        len,
        map_len,
        reserve: (p.cast(), map_len),
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
        unsafe { libc::munmap(self.reserve.0.cast(), self.reserve.1) };
    }
}

/// The hugetlb limits of this process's cgroups (Kubernetes sets them from the pod's `hugepages-2Mi` /
/// `hugepages-1Gi` requests). Where the kernel charges hugetlb pages to the cgroup only at first touch
/// (cgroup v1, or v2 without reservation accounting), a mapping beyond the limit is granted by `mmap`
/// from the node's free pool and then killed by SIGBUS while being packed; checking first lets the
/// buffer fall back to THP instead.
mod cgroup {
    /// Whether `bytes` more of `page`-sized hugetlb pages fit under every visible cgroup limit
    /// (true when no limit is visible).
    pub fn hugetlb_room(page: usize, bytes: u64) -> bool {
        let size = if page >= super::GB1 { "1GB" } else { "2MB" };
        let Ok(text) = std::fs::read_to_string("/proc/self/cgroup") else {
            return true;
        };
        limits(&text, size)
            .into_iter()
            .all(|(limit, usage)| usage.saturating_add(bytes) <= limit)
    }

    /// (limit, usage) in bytes of the cgroup of each `/proc/self/cgroup` line and its visible
    /// ancestors: cgroup v2 (`0::/path`: `hugetlb.2MB.max` / `.current`) or v1's hugetlb hierarchy
    /// (`limit_in_bytes` / `usage_in_bytes`).
    fn limits(proc_cgroup: &str, size: &str) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for line in proc_cgroup.lines() {
            let mut f = line.splitn(3, ':');
            let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            let (root, limit, usage) = if ctrl.is_empty() {
                ("/sys/fs/cgroup", "max", "current")
            } else if ctrl.split(',').any(|c| c == "hugetlb") {
                ("/sys/fs/cgroup/hugetlb", "limit_in_bytes", "usage_in_bytes")
            } else {
                continue;
            };
            let mut dir = std::path::PathBuf::from(format!("{root}{}", path.trim_end_matches('/')));
            loop {
                let read = |what: &str| {
                    std::fs::read_to_string(dir.join(format!("hugetlb.{size}.{what}"))).ok()
                };
                if let (Some(l), Some(u)) = (read(limit), read(usage)) {
                    if let (Some(l), Some(u)) = (parse_bytes(&l), parse_bytes(&u)) {
                        out.push((l, u));
                    }
                }
                if dir.as_os_str().len() <= root.len() || !dir.pop() {
                    break;
                }
            }
        }
        out
    }

    /// A cgroup byte count; `max` (no limit) is `u64::MAX`.
    pub(super) fn parse_bytes(s: &str) -> Option<u64> {
        match s.trim() {
            "max" => Some(u64::MAX),
            n => n.parse().ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_zeroed_aligned_memory_in_every_mode() {
        for mode in ["auto", "1G", "2M", "thp", "off"] {
            let mode: HugepageMode = mode.parse().unwrap();
            let mut b = HugeBuffer::new(3 << 20, mode, None);
            assert_eq!(b.as_ptr() as usize % 64, 0);
            assert!(b.iter().all(|&x| x == 0));
            b[12345] = 7;
            assert_eq!(b[12345], 7);
            match mode {
                HugepageMode::Off => assert_eq!(b.kind(), PageKind::Plain),
                HugepageMode::Transparent => assert_eq!(b.kind(), PageKind::Transparent),
                _ => {}
            }
        }
        assert!("3M".parse::<HugepageMode>().is_err());
    }

    #[test]
    fn plain_and_thp_buffers_sit_in_their_own_vma() {
        // two buffers mapped back to back: each one's smaps entry is its own mapping, no neighbour's
        for mode in [HugepageMode::Off, HugepageMode::Transparent] {
            let mut a = HugeBuffer::new(5 << 20, mode, None);
            let mut b = HugeBuffer::new(3 << 20, mode, None);
            if mode == HugepageMode::Transparent {
                assert_eq!(a.as_ptr() as usize % MB2, 0, "THP buffers start on 2 MiB");
                assert_eq!(a.mapped_range().1, 6 << 20, "and cover whole 2 MiB");
            }
            a.iter_mut().step_by(PAGE).for_each(|x| *x = 1);
            b.iter_mut().step_by(PAGE).for_each(|x| *x = 1);
            let ba = backing_of([&a]).unwrap();
            assert_eq!(ba.mapped, a.mapped_range().1 as u64, "{mode:?}: {ba:?}");
            // a THP buffer's last huge page covers its 5th MiB and the padding after it
            assert!(
                ba.resident() >= 5 << 20 && ba.resident() <= ba.mapped,
                "{ba:?}"
            );
            let both = backing_of([&a, &b]).unwrap();
            assert_eq!(both.mapped, ba.mapped + b.mapped_range().1 as u64);
            if mode == HugepageMode::Off {
                assert_eq!(ba.small, 5 << 20, "plain pages touched every 4 KiB");
            }
        }
    }

    #[test]
    fn collapse_leaves_contents_and_reports_every_range() {
        let pool = WorkerPool::new(&[vec![0, 0]], false, std::time::Duration::from_micros(10));
        let mut a = HugeBuffer::new(6 << 20, HugepageMode::Transparent, None);
        let plain = HugeBuffer::new(4 << 20, HugepageMode::Off, None);
        for (i, x) in a.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        let r = collapse_to_huge_pages(&[&a, &plain], &pool);
        assert!(a.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        assert_eq!(a.kind(), PageKind::Transparent);
        assert_eq!(r.ranges, 3, "only the THP buffer's three 2 MiB ranges");
        assert!(r.failed + r.skipped <= r.ranges);
        let b = backing_of([&a]).unwrap();
        assert_eq!(b.resident(), 6 << 20, "{b:?}");
        if !r.unsupported && r.failed == 0 && thp_enabled() {
            assert_eq!(b.thp, 6 << 20, "every range collapsed: {r:?} {b:?}");
        }
    }

    /// THP not switched off system-wide.
    fn thp_enabled() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| !s.contains("[never]"))
    }

    #[test]
    fn cgroup_limits_parse() {
        assert_eq!(cgroup::parse_bytes("max\n"), Some(u64::MAX));
        assert_eq!(cgroup::parse_bytes("4194304\n"), Some(4 << 20));
        assert_eq!(cgroup::parse_bytes("x"), None);
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
