//! The AMX tile configuration of each thread, loaded once and kept: `ldtilecfg` (and the
//! `tilerelease` that used to end every kernel call) cost a few hundred cycles each, and a 64-token
//! prefill makes thousands of kernel calls per step (one per two N-tiles of every projection). A
//! thread loads a configuration only when the kernel it runs wants another one than it holds; the
//! tiles stay configured between calls and pool regions (the OS saves them with the thread's state).
//!
//! Every `ldtilecfg` of the crate goes through [`use_config`]: the record of what a thread holds is
//! only right while nothing else configures or releases its tiles.

use std::arch::asm;
use std::cell::Cell;

/// A 64-byte `ldtilecfg` operand (palette 1).
#[repr(C, align(64))]
pub(crate) struct TileConfig(pub(crate) [u8; 64]);

impl TileConfig {
    /// Palette 1 with tile `t` as `rows × colsb` for each `(t, rows, colsb)`; other tiles unused.
    pub(crate) const fn new(tiles: &[(usize, usize, usize)]) -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut i = 0;
        while i < tiles.len() {
            let (t, rows, colsb) = tiles[i];
            c[16 + 2 * t] = colsb as u8;
            c[48 + t] = rows as u8;
            i += 1;
        }
        TileConfig(c)
    }
}

thread_local! {
    /// The configuration this thread's tiles hold (null: none yet).
    static HELD: Cell<*const TileConfig> = const { Cell::new(std::ptr::null()) };
}

/// Makes `cfg` this thread's tile configuration, loading it only when the thread holds another.
///
/// # Safety
/// The CPU has AMX-TILE and this process got the XTILEDATA permission (tier `Amx`).
#[inline]
pub(crate) unsafe fn use_config(cfg: &'static TileConfig) {
    let want = cfg as *const TileConfig;
    if HELD.with(Cell::get) == want {
        return;
    }
    // SAFETY: (caller) AMX usable; `cfg` is a valid 64-byte palette-1 configuration.
    unsafe {
        asm!("ldtilecfg [{0}]", in(reg) want, options(nostack, readonly, preserves_flags));
    }
    HELD.with(|h| h.set(want));
}
