#!/usr/bin/env bash
# llama.cpp's own quantizer on a GGUF: builds libllama (CPU only) from the peer kit with a 15-line main
# calling llama_model_quantize (the kit has no tools/quantize), then quantizes IN to OUT as FTYPE.
#   bash scripts/llama_quantize.sh IN.gguf OUT.gguf 15        # 15 = LLAMA_FTYPE_MOSTLY_Q4_K_M (2 Q4_0, 7 Q8_0)
# Build: ~9 min on 2 cores, once (WORK, default /tmp/llama-quant). KIT: the peer kit (llamacpp-src.tar.gz).
# Used to check the GGUF writers' type rule (gguf_random.q4_k_m_type) and our loader against real
# quantizer output (daemon test engine::gpu::memory::gguf_tests::llama_cpp_q4_k_m_smallthinker_runs_as_its_f32_twin).
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 IN.gguf OUT.gguf FTYPE" >&2; exit 2; }
KIT=${KIT:-$(cd "$(dirname "$0")/.." && pwd)/.device/peers/kit}
WORK=${WORK:-/tmp/llama-quant}
BIN=$WORK/llama.cpp/build/bin/quantize-ftype
if [ ! -x "$BIN" ]; then
  mkdir -p "$WORK" && tar -xzf "$KIT"/llamacpp-src.tar.gz -C "$WORK"
  src=$WORK/llama.cpp/tools/quantize-ftype
  mkdir -p "$src"
  cat > "$src/main.cpp" <<'CPP'
#include "llama.h"
#include <cstdio>
#include <cstdlib>
int main(int argc, char ** argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s in.gguf out.gguf ftype\n", argv[0]); return 2; }
    llama_backend_init();
    llama_model_quantize_params p = llama_model_quantize_default_params();
    p.ftype = (llama_ftype) atoi(argv[3]);
    uint32_t rc = llama_model_quantize(argv[1], argv[2], &p);
    llama_backend_free();
    return rc == 0 ? 0 : 1;
}
CPP
  echo 'add_executable(quantize-ftype main.cpp)
target_link_libraries(quantize-ftype PRIVATE llama ${CMAKE_THREAD_LIBS_INIT})' > "$src/CMakeLists.txt"
  echo 'add_subdirectory(quantize-ftype)' >> "$WORK/llama.cpp/tools/CMakeLists.txt"
  cmake -S "$WORK/llama.cpp" -B "$WORK/llama.cpp/build" -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DGGML_OPENMP=OFF -DCMAKE_BUILD_TYPE=Release > "$WORK/cmake.log"
  cmake --build "$WORK/llama.cpp/build" --target quantize-ftype -j "${JOBS:-2}" > "$WORK/build.log"
fi
"$BIN" "$1" "$2" "$3"
