//! Helpers shared by the integration tests that compare against the committed fixtures. Each test binary
//! uses a subset of them.
#![allow(dead_code)]

pub mod kv_pressure;
pub mod sliding;
use std::path::PathBuf;

/// `tests/fixtures`, or `MOE_FIXTURES` when set (the GPU machine runs test binaries from elsewhere).
pub fn fixtures_root() -> PathBuf {
    std::env::var_os("MOE_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
}

/// Relative L2 distance of `a` from the reference `b`.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}
