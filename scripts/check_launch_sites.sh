#!/usr/bin/env bash
# Kernels are launched only by the typed op layer in kernels/src/cuda: every other Rust file calls its
# safe functions (launch configuration, argument checks and SAFETY notes live there, once). This check
# fails on a raw launch anywhere else: a launch builder or call (`launch_builder(`, `.launch(`,
# `.launch_cooperative(`, a driver `cuLaunch*`), or the argument types a raw launch is built from
# (`LaunchArgs`, `PushKernelArg`, `LaunchConfig`). Comments are not code and do not count.
#   bash scripts/check_launch_sites.sh [ROOT]      ROOT: a checkout (default: this repository)
#   bash scripts/check_launch_sites.sh --self-test  shows that the check fails on a planted launch
set -euo pipefail

PATTERN='launch_builder[[:space:]]*\(|\.launch(_cooperative)?[[:space:]]*\(|cuLaunch[A-Za-z]*[[:space:]]*\(|\bLaunchArgs\b|\bPushKernelArg\b|\bLaunchConfig\b'
ALLOWED='kernels/src/cuda/'

check() {  # ROOT: prints each raw launch outside $ALLOWED; fails if there is one
  local root=$1 hits
  # every line's code (before any `//` comment) as FILE:LINE: CODE, then the launches among them
  hits=$(cd "$root" && find . \( -name target -o -name .git -o -name node_modules \) -prune -o \
           -name '*.rs' -not -path "./$ALLOWED*" -print0 \
         | xargs -0 -r awk '{ code = $0; sub(/\/\/.*/, "", code); print substr(FILENAME, 3) ":" FNR ": " code }' \
         | grep -E "^[^:]+:[0-9]+: .*($PATTERN)" || true)
  if [ -n "$hits" ]; then
    echo "$hits"
    echo "raw kernel launches outside $ALLOWED (add a typed op in kernels/src/cuda/ops and call it)" >&2
    return 1
  fi
}

if [ "${1:-}" = "--self-test" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/kernels/src/cuda" "$tmp/daemon/src"
  echo 'fn f() { unsafe { l.launch(cfg) }.unwrap(); }' > "$tmp/kernels/src/cuda/op.rs"
  echo '// a comment about l.launch(cfg) is not a launch' > "$tmp/daemon/src/ok.rs"
  check "$tmp" > /dev/null || { echo "self-test: a clean tree was refused" >&2; exit 1; }
  printf 'fn g() {\n    let mut l = dev.stream\n        .launch_builder(&f);\n}\n' > "$tmp/daemon/src/bad.rs"
  if check "$tmp" > /dev/null 2>&1; then echo "self-test: a planted launch_builder was not found" >&2; exit 1; fi
  rm "$tmp/daemon/src/bad.rs"
  echo 'fn h(l: &mut LaunchArgs) { unsafe { l.launch(c) }; }' > "$tmp/daemon/src/bad.rs"
  if check "$tmp" > /dev/null 2>&1; then echo "self-test: a planted .launch( was not found" >&2; exit 1; fi
  echo "check_launch_sites self-test: ok"
  exit 0
fi

root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
check "$root"
echo "no kernel launch outside $ALLOWED"
