//! What the kernel really backs a set of mappings with: reserved 1 GiB / 2 MiB pages (hugetlb),
//! transparent huge pages, or 4 KiB pages, read from `/proc/self/smaps`.
//!
//! Why: the expert kernels read each token's experts at DRAM speed only when the TLB keeps up; 4 KiB
//! pages cost a page walk every 4 KiB of a ~12 MB expert. [`HugeBuffer`](super::memory::HugeBuffer)
//! asks for huge pages but the kernel may give fewer (no reserved pages, THP off, fragmented memory), so
//! the answer is read back rather than assumed.
//!
//! Cost: reading smaps walks the page tables of every mapping of the process (tens of milliseconds at
//! tens of GB resident); read it at load and in reports, never per step.

use std::fmt;

/// Bytes of some mappings by what backs them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageBacking {
    /// Bytes mapped (resident or not).
    pub mapped: u64,
    /// Reserved 1 GiB pages in use.
    pub hugetlb_1g: u64,
    /// Reserved 2 MiB pages in use.
    pub hugetlb_2m: u64,
    /// Transparent huge pages (`AnonHugePages`).
    pub thp: u64,
    /// Resident on 4 KiB pages.
    pub small: u64,
}

impl PageBacking {
    /// Bytes resident on any kind of page.
    pub fn resident(&self) -> u64 {
        self.hugetlb_1g + self.hugetlb_2m + self.thp + self.small
    }

    /// Share of the resident bytes on 4 KiB pages (0 when nothing is resident).
    pub fn small_fraction(&self) -> f64 {
        match self.resident() {
            0 => 0.0,
            r => self.small as f64 / r as f64,
        }
    }

    fn add(&mut self, o: &PageBacking) {
        self.mapped += o.mapped;
        self.hugetlb_1g += o.hugetlb_1g;
        self.hugetlb_2m += o.hugetlb_2m;
        self.thp += o.thp;
        self.small += o.small;
    }
}

impl fmt::Display for PageBacking {
    /// `37.50 GiB mapped: 2M hugetlb 100.0%` — shares of the resident bytes, largest first.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: f64 = (1u64 << 30) as f64;
        write!(f, "{:.2} GiB mapped", self.mapped as f64 / GIB)?;
        let resident = self.resident();
        if resident == 0 {
            return f.write_str(", none resident");
        }
        let mut parts = [
            ("1G hugetlb", self.hugetlb_1g),
            ("2M hugetlb", self.hugetlb_2m),
            ("THP 2M", self.thp),
            ("4K pages", self.small),
        ];
        parts.sort_by_key(|p| std::cmp::Reverse(p.1));
        let mut sep = ": ";
        for (name, bytes) in parts.iter().filter(|p| p.1 > 0) {
            write!(
                f,
                "{sep}{name} {:.1}%",
                100.0 * *bytes as f64 / resident as f64
            )?;
            sep = ", ";
        }
        if resident < self.mapped {
            write!(
                f,
                " ({:.2} GiB not resident)",
                (self.mapped - resident) as f64 / GIB
            )?;
        }
        Ok(())
    }
}

/// The backing of the mappings that lie in `ranges` (`(start address, length)`), read from this
/// process's smaps once. A mapping (VMA) counts when it starts inside a range; callers keep their
/// ranges in VMAs of their own (see `HugeBuffer`'s guard pages), so none straddles a range's end.
pub fn read_backing(ranges: &[(usize, usize)]) -> std::io::Result<PageBacking> {
    let text = std::fs::read_to_string("/proc/self/smaps")?;
    Ok(parse_smaps(&text, ranges))
}

/// [`read_backing`] on smaps text.
pub fn parse_smaps(text: &str, ranges: &[(usize, usize)]) -> PageBacking {
    let mut total = PageBacking::default();
    let mut vma: Option<Vma> = None;
    for line in text.lines() {
        if let Some(v) = Vma::header(line) {
            if let Some(done) = vma.take() {
                done.add_to(&mut total, ranges);
            }
            vma = Some(v);
            continue;
        }
        let Some(v) = vma.as_mut() else { continue };
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let kb = || {
            rest.trim()
                .strip_suffix("kB")
                .and_then(|n| n.trim().parse::<u64>().ok())
                .map_or(0, |n| n * 1024)
        };
        match key {
            "Rss" => v.rss = kb(),
            "AnonHugePages" => v.thp = kb(),
            "KernelPageSize" => v.page = kb(),
            "Private_Hugetlb" | "Shared_Hugetlb" => v.hugetlb += kb(),
            _ => {}
        }
    }
    if let Some(done) = vma {
        done.add_to(&mut total, ranges);
    }
    total
}

/// One smaps entry.
#[derive(Default)]
struct Vma {
    start: usize,
    end: usize,
    rss: u64,
    thp: u64,
    page: u64,
    hugetlb: u64,
}

impl Vma {
    /// `7f1c2a000000-7f1c2c000000 rw-p 00000000 00:00 0  [name]`
    fn header(line: &str) -> Option<Vma> {
        let (range, _) = line.split_once(' ')?;
        let (a, b) = range.split_once('-')?;
        Some(Vma {
            start: usize::from_str_radix(a, 16).ok()?,
            end: usize::from_str_radix(b, 16).ok()?,
            ..Vma::default()
        })
    }

    fn add_to(&self, total: &mut PageBacking, ranges: &[(usize, usize)]) {
        if !ranges
            .iter()
            .any(|&(s, l)| self.start >= s && self.start < s + l)
        {
            return;
        }
        let mut b = PageBacking {
            mapped: (self.end - self.start) as u64,
            ..PageBacking::default()
        };
        if self.hugetlb > 0 || self.page >= 2 << 20 {
            // hugetlb pages are not in Rss: they have their own lines
            if self.page >= 1 << 30 {
                b.hugetlb_1g = self.hugetlb;
            } else {
                b.hugetlb_2m = self.hugetlb;
            }
        } else {
            b.thp = self.thp.min(self.rss);
            b.small = self.rss - b.thp;
        }
        total.add(&b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three entries as Linux 6.x writes them: a THP-backed anonymous mapping partly on 4 KiB pages, a
    /// 2 MiB hugetlb mapping, and one outside the ranges asked about.
    const SMAPS: &str = "\
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0 
Size:              10240 kB
KernelPageSize:        4 kB
MMUPageSize:           4 kB
Rss:                8196 kB
Pss:                8196 kB
AnonHugePages:      6144 kB
ShmemPmdMapped:        0 kB
Shared_Hugetlb:        0 kB
Private_Hugetlb:       0 kB
THPeligible:    1
VmFlags: rd wr mr mw me ac sd hg 
7f1000000000-7f1000800000 rw-p 00000000 00:10 123                      /anon_hugepage (deleted)
Size:               8192 kB
KernelPageSize:     2048 kB
MMUPageSize:        2048 kB
Rss:                   0 kB
AnonHugePages:         0 kB
Shared_Hugetlb:        0 kB
Private_Hugetlb:    6144 kB
VmFlags: rd wr mr mw me de ht sd 
7f2000000000-7f2000001000 rw-p 00000000 00:00 0 
Size:                  4 kB
KernelPageSize:        4 kB
Rss:                   4 kB
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac sd 
";

    #[test]
    fn smaps_entries_are_split_by_page_kind() {
        let ranges = [(0x7f00_0000_0000, 0xa0_0000), (0x7f10_0000_0000, 0x80_0000)];
        let b = parse_smaps(SMAPS, &ranges);
        assert_eq!(
            b,
            PageBacking {
                mapped: (10 + 8) << 20,
                hugetlb_1g: 0,
                hugetlb_2m: 6 << 20,
                thp: 6 << 20,
                small: 2052 << 10,
            }
        );
        assert_eq!(b.resident(), (12 << 20) + (2052 << 10));
        let only_thp = parse_smaps(SMAPS, &ranges[..1]);
        assert_eq!(only_thp.thp, 6 << 20);
        assert_eq!(only_thp.hugetlb_2m, 0);
        assert_eq!(
            only_thp.to_string(),
            "0.01 GiB mapped: THP 2M 75.0%, 4K pages 25.0% (0.00 GiB not resident)"
        );
        assert_eq!(parse_smaps(SMAPS, &[]), PageBacking::default());
        assert_eq!(
            PageBacking::default().to_string(),
            "0.00 GiB mapped, none resident"
        );
    }

    #[test]
    fn this_process_reads_its_own_mapping() {
        let len = 8 << 20;
        // SAFETY: anonymous mapping, checked, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: our mapping; touch the first 2 MiB only.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 1, 2 << 20) };
        // The test threads beside this one map and unmap memory while smaps is read (in chunks, each
        // resuming at an address): an entry can be missed, so a read that misses ours is taken again.
        let read = || read_backing(&[(p as usize, len)]).unwrap();
        let b = (0..3)
            .map(|_| read())
            .find(|b| b.mapped >= len as u64)
            .unwrap_or_else(read);
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(p, len) };
        // a neighbouring mapping may have merged into the VMA: at least ours is there
        assert!(b.mapped >= len as u64, "{b:?}");
        assert!(b.resident() >= 2 << 20, "{b:?}");
        assert_eq!(b.hugetlb_1g + b.hugetlb_2m, 0);
    }
}
