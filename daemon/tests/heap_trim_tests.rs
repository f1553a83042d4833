//! The loader's freed buffers leave the resident set after `release_freed_heap`. Its own test binary:
//! resident-set figures are per process, so no other test may allocate beside it.

use moe_daemon::engine::heap::{release_freed_heap, resident_bytes};

const MIB: usize = 1 << 20;

#[test]
fn freed_loader_buffers_leave_the_resident_set() {
    // A freed 16 MiB mapping raises glibc's mmap threshold, so the 4 MiB buffers below come from the
    // arena heap, as the loader's tensors do.
    drop(std::hint::black_box(vec![1u8; 16 * MIB]));
    let mut bufs: Vec<Option<Vec<u8>>> = (0..64).map(|i| Some(vec![i as u8; 4 * MIB])).collect();
    // Free every other buffer: the holes sit between live chunks, where free() alone never returns
    // pages to the OS (only the heap's top can shrink).
    for b in bufs.iter_mut().step_by(2) {
        *b = None;
    }
    let held = resident_bytes().expect("/proc/self/statm is readable on Linux");
    release_freed_heap("test");
    let now = resident_bytes().expect("/proc/self/statm is readable on Linux");
    std::hint::black_box(&bufs);
    // 128 MiB sit in holes; allow for the pages malloc keeps around each chunk header.
    assert!(
        held.saturating_sub(now) as usize > 96 * MIB,
        "resident {} MiB before the trim, {} MiB after",
        held as usize / MIB,
        now as usize / MIB
    );
}
