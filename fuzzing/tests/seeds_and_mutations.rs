//! Every fuzz target on its committed seeds and on mutations of them, within a time budget per
//! target: the CI share of fuzzing (the long libFuzzer runs with sanitizers are `scripts/fuzz.sh`).
//! A panic, a failed assertion or an arithmetic overflow (debug build) fails the test, and the input
//! is written to `target/fuzz-smoke/<target>.bin` to replay with
//! `cargo +nightly fuzz run <target> target/fuzz-smoke/<target>.bin`.
//!
//! `MOE_FUZZ_SMOKE_SECONDS` (default 3) sets the budget per target; `MOE_FUZZ_SMOKE_SEED` the mutator's
//! seed (default fixed, so a CI failure replays).

use moe_fuzzing::mutate::{mutate, Rng};
use moe_fuzzing::TARGETS;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = repo().join("fuzz/seeds").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("seed entry").path())
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read(p).expect("seed"))
        .collect()
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `body` on `input`; on a panic, saves the input and fails with where to find it.
fn run_one(target: &str, body: fn(&[u8]), input: &[u8], count: usize) {
    if catch_unwind(AssertUnwindSafe(|| body(input))).is_err() {
        let dir = repo().join("target/fuzz-smoke");
        std::fs::create_dir_all(&dir).expect("crash dir");
        let path = dir.join(format!("{target}.bin"));
        std::fs::write(&path, input).expect("crash input");
        panic!(
            "fuzz target {target} panicked on input {count} ({} bytes), saved to {}",
            input.len(),
            path.display()
        );
    }
}

#[test]
fn every_target_survives_its_seeds_and_their_mutations() {
    let budget = Duration::from_secs_f64(env_or("MOE_FUZZ_SMOKE_SECONDS", 3.0));
    let seed = env_or("MOE_FUZZ_SMOKE_SEED", 0x5eed_u64);
    let mut report = Vec::new();
    for &(target, body) in TARGETS {
        let corpus = seeds(target);
        assert!(!corpus.is_empty(), "{target}: no seeds");
        let start = Instant::now();
        for (i, s) in corpus.iter().enumerate() {
            run_one(target, body, s, i);
        }
        let mut rng = Rng::new(seed ^ target.len() as u64);
        let mut count = corpus.len();
        while start.elapsed() < budget {
            let a = &corpus[rng.below(corpus.len())];
            let b = &corpus[rng.below(corpus.len())];
            let input = mutate(&mut rng, a, b);
            run_one(target, body, &input, count);
            count += 1;
        }
        report.push(format!("{target}: {count}"));
    }
    eprintln!("inputs run per target: {}", report.join(", "));
}
