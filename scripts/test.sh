#!/usr/bin/env bash
# The project's test command (the README names it; .ci/run calls it).
# Lints, then every Rust test of the workspace, then the Python-driven checks that exist.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace

# Operator: Helm chart lint/render (helm-python-sdk), rendered objects checked by `moe-operator
# validate`, examples against the CRD schema. Uses target/debug/moe-operator, which `cargo test`
# built above (the CLI integration tests need it), so no second build with other features.
python3 -m unittest discover -s tests/operator -p "test_*.py"
