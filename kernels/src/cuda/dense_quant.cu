// ---- dense projections with 4-bit and 8-bit weights (W4A16, W8A16) ---------------------------------
// Appended to kernels.cu (uses its bf16 helpers and warp_sum). Layouts, built at load by cuda/quant.rs:
//   int4: row-major [out, in/8] u32; word j of a row holds inputs 8j..8j+7, input 8j+i in bits 4i..4i+3
//         as a code u in 0..15; one f16 scale d per row and group of `group` inputs, and optionally an
//         f16 minimum m per row and group: w = (u - 8) * d (symmetric, mins == 0) or u * d + m
//         (asymmetric: GGUF Q4_1 / Q4_K codes kept as stored).
//   w8:   row-major [out, in] bytes, E4M3 (code 0) or int8 (code 1, kept GGUF Q8_0 / Q6_K codes); one f32
//         scale per row and group: w = value(byte) * scale.
// Decode (a few tokens) runs the GEMVs below, which read each weight byte once for all tokens: the
// step is bound by weight bandwidth, so 4-bit weights read ~3.8x fewer bytes than bf16. Prefill
// dequantizes row slabs into a bf16 scratch buffer and multiplies with cuBLAS (dense_dequant_*).

// (h2f, f16 bits -> f32, is common.cuh's.)
// E4M3 (fn) -> f32: the 7 value bits placed as an f16 of exponent bias 15 are the E4M3 value times
// 2^-8 (normal and subnormal alike), so one shift, one conversion and one multiply. NaN codes are
// never produced by the quantizer.
__device__ __forceinline__ float e4m3_to_f32(unsigned int b) {
    unsigned short h = (unsigned short)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    return h2f(h) * 256.f;
}

#define GEMV_MAX_TOKENS 8
#define GEMV_ROWS_PER_BLOCK 4

// Dot products of `n` bf16 rows of x (8 values from column c on, as one 16-byte load) with 8 weights.
__device__ __forceinline__ void dot8(const bf16* x, int in, int n, int c, const float* wv, float* part) {
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
        if (t < n) {
            uint4 xv = *(const uint4*)(x + (size_t)t * in + c);
            unsigned int xs[4] = {xv.x, xv.y, xv.z, xv.w};
            float p = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p += wv[2 * i] * __uint_as_float(xs[i] << 16);
                p += wv[2 * i + 1] * __uint_as_float(xs[i] & 0xffff0000u);
            }
            part[t] += p;
        }
    }
}

__device__ __forceinline__ void gemv_store(float* acc, int n, int out, int r, int accumulate, float* y) {
    int lane = threadIdx.x % WARP;
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
        if (t < n) {
            float v = warp_sum(acc[t]);
            if (lane == 0) {
                size_t i = (size_t)t * out + r;
                y[i] = accumulate ? y[i] + v : v;
            }
        }
    }
}

// y[t, r] (=|+=) x[t] . W[r] for t < n <= GEMV_MAX_TOKENS. One warp per output row; each lane takes 32
// consecutive inputs (one 16-byte load of weights) per step, so a warp reads 512 contiguous bytes.
// x: bf16 [n, in]; in % 32 == 0, group % 32 == 0. grid: ceil(out / 4), block: 128.
// mins: per-group f16 minimums of asymmetric codes, or 0 (symmetric codes).
extern "C" __global__ void gemv_w4a16(const unsigned int* w, const unsigned short* scales,
                                      const unsigned short* mins, const bf16* x, int n, int out, int in,
                                      int group, int accumulate, float* y) {
    int r = blockIdx.x * GEMV_ROWS_PER_BLOCK + threadIdx.x / WARP;
    if (r >= out) return;
    int lane = threadIdx.x % WARP;
    float acc[GEMV_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] = 0.f;
    const uint4* wr = (const uint4*)(w + (size_t)r * (in / 8));
    const unsigned short* sr = scales + (size_t)r * (in / group);
    const unsigned short* mr = mins ? mins + (size_t)r * (in / group) : nullptr;
    for (int c = lane * 32; c < in; c += WARP * 32) {
        uint4 q = wr[c / 32];
        // 32 inputs lie in one group (group % 32 == 0). Asymmetric codes are dequantized per weight
        // (one FMA, shared by the tokens); symmetric ones are scaled after the dot products.
        float s = h2f(sr[c / group]);
        float m = mr ? h2f(mr[c / group]) : 0.f;
        unsigned int words[4] = {q.x, q.y, q.z, q.w};
        float part[GEMV_MAX_TOKENS];
#pragma unroll
        for (int t = 0; t < GEMV_MAX_TOKENS; ++t) part[t] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float wv[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                unsigned int u = (words[j] >> (4 * i)) & 15u;
                wv[i] = mr ? fmaf((float)u, s, m) : (float)((int)u - 8);
            }
            dot8(x, in, n, c + 8 * j, wv, part);
        }
        float post = mr ? 1.f : s;
#pragma unroll
        for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] += post * part[t];
    }
    gemv_store(acc, n, out, r, accumulate, y);
}

// An 8-bit weight byte as a value: E4M3 (code 0) or int8 (code 1).
__device__ __forceinline__ float w8_decode(unsigned int b, int code) {
    return code ? (float)(signed char)b : e4m3_to_f32(b);
}

// As gemv_w4a16 for 8-bit weights: each lane takes 16 consecutive inputs (16 bytes) per step.
// in % 16 == 0, group % 16 == 0. grid: ceil(out / 4), block: 128.
extern "C" __global__ void gemv_w8a16(const unsigned char* w, const float* scales, int code, const bf16* x,
                                      int n, int out, int in, int group, int accumulate, float* y) {
    int r = blockIdx.x * GEMV_ROWS_PER_BLOCK + threadIdx.x / WARP;
    if (r >= out) return;
    int lane = threadIdx.x % WARP;
    float acc[GEMV_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] = 0.f;
    const uint4* wr = (const uint4*)(w + (size_t)r * in);
    const float* sr = scales + (size_t)r * (in / group);
    for (int c = lane * 16; c < in; c += WARP * 16) {
        uint4 q = wr[c / 16];
        unsigned int words[4] = {q.x, q.y, q.z, q.w};
        float part[GEMV_MAX_TOKENS];
#pragma unroll
        for (int t = 0; t < GEMV_MAX_TOKENS; ++t) part[t] = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float wv[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = w8_decode((words[2 * j + i / 4] >> (8 * (i % 4))) & 255u, code);
            dot8(x, in, n, c + 8 * j, wv, part);
        }
        float s = sr[c / group];
#pragma unroll
        for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] += s * part[t];
    }
    gemv_store(acc, n, out, r, accumulate, y);
}

// Rows r0..r0+gridDim.x of an int4 matrix -> bf16 [rows, in] (the prefill GEMM's weight slab).
// grid: rows, block: 256.
// mins: as gemv_w4a16's.
extern "C" __global__ void dense_dequant_w4(const unsigned int* w, const unsigned short* scales,
                                            const unsigned short* mins, int in, int group, int r0, bf16* out) {
    size_t row = (size_t)r0 + blockIdx.x;
    const unsigned int* wr = w + row * (in / 8);
    const unsigned short* sr = scales + row * (in / group);
    const unsigned short* mr = mins ? mins + row * (in / group) : nullptr;
    bf16* o = out + (size_t)blockIdx.x * in;
    for (int j = threadIdx.x; j < in / 8; j += blockDim.x) {
        unsigned int q = wr[j];
        float s = h2f(sr[(8 * j) / group]);
        float m = mr ? h2f(mr[(8 * j) / group]) : -8.f * s;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[8 * j + i] = f2bf(fmaf((float)((q >> (4 * i)) & 15u), s, m));
    }
}

// Rows r0..r0+gridDim.x of an 8-bit matrix -> bf16 [rows, in]. grid: rows, block: 256.
extern "C" __global__ void dense_dequant_w8(const unsigned char* w, const float* scales, int code, int in,
                                            int group, int r0, bf16* out) {
    size_t row = (size_t)r0 + blockIdx.x;
    const unsigned char* wr = w + row * in;
    const float* sr = scales + row * (in / group);
    bf16* o = out + (size_t)blockIdx.x * in;
    for (int c = threadIdx.x; c < in; c += blockDim.x) o[c] = f2bf(w8_decode(wr[c], code) * sr[c / group]);
}
