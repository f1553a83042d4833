//! Hands the loader's freed host memory back to the operating system.
//!
//! Loading reads tensors into host buffers that die once the weights are packed for the CPU kernels or
//! uploaded to the GPU. glibc keeps freed chunks in its arenas: the loader runs on its own thread (its own
//! arena), and after the first large free glibc raises its mmap threshold to 32 MiB, so later tensors come
//! from arena heaps instead of private mappings and are not unmapped when freed. Without a trim the server
//! keeps gigabytes of dead loader buffers resident. `malloc_trim(0)` walks every arena and returns their
//! free pages (madvise), a one-off cost of milliseconds. The GPU warm-up after loading frees its own
//! step's host buffers on that thread, so the trim runs again after it.
//!
//! [`MemoryReport`] says where a process's resident memory is (anonymous, file-backed, shared memory,
//! locked or pinned, malloc's free chunks): `serve` logs it when ready and `bench` prints it at the
//! end, so the two can be compared on the same model.

/// Resident set size of this process in bytes, from `/proc/self/statm`; None where that is unreadable.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions; it returns -1 on error, which try_from rejects.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    Some(pages * page)
}

/// Returns free heap pages of every malloc arena to the OS and logs how much the resident set shrank.
pub fn release_freed_heap(after: &str) {
    let before = resident_bytes();
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only inspects and releases glibc's own free lists; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
    if let (Some(b), Some(a)) = (before, resident_bytes()) {
        tracing::info!(
            after,
            resident_mib = a >> 20,
            released_mib = b.saturating_sub(a) >> 20,
            "returned freed host memory to the OS"
        );
    }
}

/// A process's resident memory by kind, from `/proc/self/status` (kB there, bytes here) and glibc's
/// `mallinfo2`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Resident now and at most so far.
    pub rss: u64,
    pub hwm: u64,
    /// Anonymous pages (heap, packed experts without hugetlb pages), file-backed mappings (a
    /// checkpoint still mapped), shared memory (tmpfs files mapped: a checkpoint in /dev/shm).
    pub anon: u64,
    pub file: u64,
    pub shmem: u64,
    /// Locked and pinned pages (the expert stream registers the packed experts with the driver).
    pub locked: u64,
    pub pinned: u64,
    /// malloc: bytes in use, and bytes free inside its arenas (resident unless trimmed).
    pub malloc_used: u64,
    pub malloc_free: u64,
}

impl MemoryReport {
    /// This process now; `None` where `/proc` is unreadable.
    pub fn now() -> Option<MemoryReport> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let mut r = MemoryReport::parse_status(&status)?;
        #[cfg(target_env = "gnu")]
        {
            // SAFETY: mallinfo2 only reads glibc's own counters.
            let m = unsafe { libc::mallinfo2() };
            r.malloc_used = (m.uordblks + m.hblkhd) as u64;
            r.malloc_free = m.fordblks as u64;
        }
        Some(r)
    }

    /// The `/proc/<pid>/status` fields; `None` without a VmRSS line.
    pub fn parse_status(status: &str) -> Option<MemoryReport> {
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(name))?;
            let kb: u64 = line[name.len()..]
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(kb << 10)
        };
        Some(MemoryReport {
            rss: field("VmRSS:")?,
            hwm: field("VmHWM:").unwrap_or(0),
            anon: field("RssAnon:").unwrap_or(0),
            file: field("RssFile:").unwrap_or(0),
            shmem: field("RssShmem:").unwrap_or(0),
            locked: field("VmLck:").unwrap_or(0),
            pinned: field("VmPin:").unwrap_or(0),
            malloc_used: 0,
            malloc_free: 0,
        })
    }
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "resident {:.2} GiB (peak {:.2}): anonymous {:.2}, file-backed {:.2}, shared memory {:.2}; locked {:.2}, pinned {:.2}; malloc in use {:.2}, free in its arenas {:.2} (hugetlb pages are not counted as resident)",
            gib(self.rss),
            gib(self.hwm),
            gib(self.anon),
            gib(self.file),
            gib(self.shmem),
            gib(self.locked),
            gib(self.pinned),
            gib(self.malloc_used),
            gib(self.malloc_free),
        )
    }
}

#[cfg(test)]
mod report_tests {
    use super::MemoryReport;

    #[test]
    fn status_fields_are_read_in_bytes() {
        let status = "Name:\tmoe-daemon\nVmHWM:\t 2000 kB\nVmRSS:\t 1000 kB\nRssAnon:\t 600 kB\nRssFile:\t 300 kB\nRssShmem:\t 100 kB\nVmLck:\t 0 kB\nVmPin:\t 64 kB\n";
        let r = MemoryReport::parse_status(status).unwrap();
        assert_eq!((r.rss, r.hwm), (1000 << 10, 2000 << 10));
        assert_eq!((r.anon, r.file, r.shmem), (600 << 10, 300 << 10, 100 << 10));
        assert_eq!((r.locked, r.pinned), (0, 64 << 10));
        assert!(MemoryReport::parse_status("Name: x\n").is_none());
        let live = MemoryReport::now().unwrap();
        assert!(live.rss > 0 && live.hwm >= live.rss);
        assert!(live.to_string().starts_with("resident "));
    }
}
