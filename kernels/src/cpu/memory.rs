//! Expert weight memory: one zero-filled mapping per allocation, 64-byte aligned (page aligned in fact),
//! on explicit hugepages when reserved, else transparent hugepages, else plain pages; optionally bound
//! to one NUMA node.
//!
//! Why: a decode token streams ~75 MB of scattered experts per layer; 4 KiB pages would cost a TLB miss
//! every 4 KiB. 1 GiB pages are used only when the rounding waste stays under 1/8 of the request.

use std::fmt;
use std::str::FromStr;

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
}

// SAFETY: owns its mapping exclusively, like a Box<[u8]>.
unsafe impl Send for HugeBuffer {}
unsafe impl Sync for HugeBuffer {}

const MB2: usize = 2 << 20;
const GB1: usize = 1 << 30;

impl HugeBuffer {
    /// Maps `len` bytes (at least 1) following `mode`; `numa_node` binds the pages to that node (mbind,
    /// before first touch). Falls back down the list rather than failing; panics only if even plain
    /// anonymous memory cannot be mapped (out of memory).
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
    if let Some(n) = node {
        bind_to_node(p, map_len, n);
    }
    Some(HugeBuffer {
        ptr: p.cast(),
        len,
        map_len,
        kind,
    })
}

/// mbind(MPOL_BIND) to one node; best effort (single-node machines and containers without the
/// capability simply keep first-touch placement, which the repack done by node-local threads gives too).
fn bind_to_node(p: *mut libc::c_void, len: usize, node: usize) {
    const MPOL_BIND: libc::c_long = 2;
    if node >= 64 {
        return;
    }
    let mask: u64 = 1 << node;
    // SAFETY: mbind on our own mapping with a one-word node mask.
    unsafe {
        libc::syscall(
            libc::SYS_mbind,
            p,
            len,
            MPOL_BIND,
            &mask as *const u64,
            65usize,
            0usize,
        );
    }
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
}
