//! CPU feature detection, done once per process, and the kernel tiers built on it.
//!
//! A tier is a set of instructions a kernel family needs. Detection checks both the CPUID bits and that the
//! OS saves the register state (XCR0; for AMX also the Linux `arch_prctl` permission request), so a tier
//! reported available never raises an illegal instruction. Tests and benchmarks can force a lower tier
//! with [`CpuTier`] arguments; they can never force a higher one than detected.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// Kernel families, ordered from slowest to fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuTier {
    /// Portable Rust, f32 arithmetic on dequantized weights: the reference.
    Scalar,
    /// AVX2 + FMA, f32 arithmetic.
    Avx2,
    /// AVX-512 F/BW/VL + BF16 (`vdpbf16ps`) + VNNI (`vpdpbusd`): decode (few tokens per expert).
    Avx512,
    /// Avx512 plus AMX-TILE/BF16/INT8 tiles for experts that receive many tokens.
    Amx,
}

impl CpuTier {
    pub const ALL: [CpuTier; 4] = [
        CpuTier::Scalar,
        CpuTier::Avx2,
        CpuTier::Avx512,
        CpuTier::Amx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CpuTier::Scalar => "scalar",
            CpuTier::Avx2 => "avx2",
            CpuTier::Avx512 => "avx512",
            CpuTier::Amx => "amx",
        }
    }

    /// Tiers this CPU can run, lowest first (always contains `Scalar`).
    pub fn available() -> Vec<CpuTier> {
        let best = detected_tier();
        CpuTier::ALL.into_iter().filter(|t| *t <= best).collect()
    }

    /// `self` if the CPU supports it, else the best detected tier below it.
    pub fn clamp_to_cpu(self) -> CpuTier {
        self.min(detected_tier())
    }
}

impl fmt::Display for CpuTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpuTier {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        CpuTier::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown CPU tier {s:?} (expected scalar|avx2|avx512|amx)"))
    }
}

/// The best tier of this CPU, detected on first call.
pub fn detected_tier() -> CpuTier {
    static TIER: OnceLock<CpuTier> = OnceLock::new();
    *TIER.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuTier {
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    if !avx2 {
        return CpuTier::Scalar;
    }
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx512vnni");
    if !avx512 {
        return CpuTier::Avx2;
    }
    if amx_usable() {
        CpuTier::Amx
    } else {
        CpuTier::Avx512
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuTier {
    CpuTier::Scalar
}

/// AMX needs CPUID leaf 7 EDX bits 22 (BF16), 24 (TILE), 25 (INT8), and on Linux a one-time
/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` so the kernel grows this process's XSAVE area.
#[cfg(target_arch = "x86_64")]
fn amx_usable() -> bool {
    use std::arch::x86_64::__cpuid_count;
    let leaf7 = __cpuid_count(7, 0);
    let bits = (1 << 22) | (1 << 24) | (1 << 25);
    if leaf7.edx & bits != bits {
        return false;
    }
    request_amx_permission()
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_amx_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain syscall with integer arguments; it only changes this process's XSAVE permissions.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_amx_permission() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_parse_and_clamp() {
        for t in CpuTier::ALL {
            assert_eq!(t.name().parse::<CpuTier>().unwrap(), t);
            assert!(t.clamp_to_cpu() <= detected_tier());
        }
        assert!("avx9".parse::<CpuTier>().is_err());
        assert_eq!(CpuTier::available()[0], CpuTier::Scalar);
    }
}
