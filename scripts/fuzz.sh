#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/fuzz_targets) from its committed seeds (fuzz/seeds/<target>),
# each for a bounded time or a fixed number of inputs, and fails on the first crash, leak, timeout or
# out-of-memory. New interesting inputs go to fuzz/corpus/<target> (not committed); a crashing input
# is left in fuzz/artifacts/<target>/ and can be replayed with
#   cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>
#
# Usage: scripts/fuzz.sh [seconds per target, default 20]
#        FUZZ_RUNS=1000000 scripts/fuzz.sh     # a fixed number of inputs per target instead
#        FUZZ_TARGETS="gguf config_json" ...    # a subset
# Needs a nightly toolchain and cargo-fuzz (`rustup toolchain install nightly`,
# `cargo install cargo-fuzz --locked`); FUZZ_TOOLCHAIN picks the toolchain (default: nightly).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
tc=${FUZZ_TOOLCHAIN:-nightly}
targets=${FUZZ_TARGETS:-$(cargo "+$tc" fuzz list)}
cargo "+$tc" fuzz build
for t in $targets; do
    mkdir -p "fuzz/corpus/$t"
    if [ -n "${FUZZ_RUNS:-}" ]; then limit="-runs=$FUZZ_RUNS"; else limit="-max_total_time=$seconds"; fi
    echo "== $t ($limit)"
    # -rss_limit_mb: a parser that allocates more than 2 GiB from a small input is a bug.
    # -timeout: one input taking over 10 s is a hang.
    log="fuzz/corpus/$t.log"
    status=0
    cargo "+$tc" fuzz run "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        "$limit" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 >"$log" 2>&1 || status=$?
    grep -E "^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)|^Done [0-9]+ runs|ERROR|panicked|SUMMARY" "$log" || true
    if [ "$status" -ne 0 ]; then
        tail -n 40 "$log" >&2
        echo "fuzz target $t failed (log: $log)" >&2
        exit 1
    fi
done
