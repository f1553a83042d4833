//! Hands the loader's freed host memory back to the operating system.
//!
//! Loading reads tensors into host buffers that die once the weights are packed for the CPU kernels or
//! uploaded to the GPU. glibc keeps freed chunks in its arenas: the loader runs on its own thread (its own
//! arena), and after the first large free glibc raises its mmap threshold to 32 MiB, so later tensors come
//! from arena heaps instead of private mappings and are not unmapped when freed. Without a trim the server
//! keeps gigabytes of dead loader buffers resident. `malloc_trim(0)` walks every arena and returns their
//! free pages (madvise), a one-off cost of milliseconds.

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
