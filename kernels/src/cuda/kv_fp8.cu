// ---- FP8 KV cache (`--kv-cache-dtype fp8`) ----
// Rows of E4M3 codes with one f32 scale per (cache row, KV head): scale = amax of that head's values / 448,
// code = e4m3(value / scale), read back as e4m3 * scale. Half the bytes of bf16 rows (plus 4 bytes per
// head and row); the scale follows each head's own range, so no calibration is needed (vLLM's fp8 cache
// without checkpoint scales uses 1.0 for the whole tensor instead).

// f32 -> E4M3 (fn), round to nearest even, saturating at +-448: the twin of quant.rs's f32_to_e4m3.
__device__ __forceinline__ unsigned char f32_to_e4m3(float x) {
    unsigned int sign = (__float_as_uint(x) >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a) return (unsigned char)(sign | 0x7fu);
    if (a >= 448.f) return (unsigned char)(sign | 0x7eu);
    unsigned int code;
    if (a < 0.015625f) {  // below 2^-6: subnormal, m * 2^-9 with m = 0..8
        code = (unsigned int)__float2int_rn(a * 512.f);
    } else {
        unsigned int bits = __float_as_uint(a);
        int exp = (int)(bits >> 23) - 127;
        unsigned int mant = bits & 0x7fffffu;
        unsigned int q = mant >> 20, rem = mant & 0xfffffu;
        unsigned int up = (rem > 0x80000u) || (rem == 0x80000u && (q & 1u));
        code = ((unsigned int)(exp + 7) << 3) + q + up;
    }
    return (unsigned char)(sign | min(code, 0x7eu));
}

struct KvFp8 {
    const unsigned char* codes;
    const float* scales;  // [rows, kv_heads]
    int width, head_dim, kv_heads;
    __device__ __forceinline__ float at(size_t slot, int kvh, int i) const {
        return e4m3_to_f32(codes[slot * width + (size_t)kvh * head_dim + i]) * scales[slot * kv_heads + kvh];
    }
};

// Writes each token's k and v rows ([tokens, kv_heads * head_dim] f32) into cache row slot_of_token[t] as
// E4M3 codes and per-head scales. One block per token, one warp per head at a time.
extern "C" __global__ void kv_append_fp8(const float* k, const float* v, int kv_heads, int head_dim,
                                         unsigned char* k_codes, unsigned char* v_codes, float* k_scales,
                                         float* v_scales, const int* slot_of_token) {
    int t = blockIdx.x, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    size_t slot = (size_t)slot_of_token[t];
    int width = kv_heads * head_dim;
    for (int job = threadIdx.x / WARP; job < 2 * kv_heads; job += warps) {
        int h = job % kv_heads;
        const float* src = (job < kv_heads ? k : v) + (size_t)t * width + (size_t)h * head_dim;
        unsigned char* dst = (job < kv_heads ? k_codes : v_codes) + slot * width + (size_t)h * head_dim;
        float* sc = (job < kv_heads ? k_scales : v_scales) + slot * kv_heads + h;
        float amax = 0.f;
        for (int i = lane; i < head_dim; i += WARP) amax = fmaxf(amax, fabsf(src[i]));
        amax = warp_max(amax);
        float s = amax > 0.f ? amax / 448.f : 1.f;
        for (int i = lane; i < head_dim; i += WARP) dst[i] = f32_to_e4m3(src[i] / s);
        if (lane == 0) *sc = s;
    }
}

extern "C" __global__ void paged_attention_fp8(const float* q, const unsigned char* k_codes,
                                               const unsigned char* v_codes, const float* k_scales,
                                               const float* v_scales, const int* block_tables, int max_blocks,
                                               const int* seq_of_token, const int* pos_of_token, int heads,
                                               int kv_heads, int head_dim, int block_size, float scale,
                                               int window, int row0, bf16* out) {
    int width = kv_heads * head_dim;
    paged_attention_rows(q, KvFp8{k_codes, k_scales, width, head_dim, kv_heads},
                         KvFp8{v_codes, v_scales, width, head_dim, kv_heads}, block_tables, max_blocks,
                         seq_of_token, pos_of_token, heads, kv_heads, head_dim, block_size, scale, window, row0,
                         out);
}

// One sequence's cached rows 0..len (FP8) -> contiguous bf16 [len, width] (long prefill's GEMM inputs).
extern "C" __global__ void gather_kv_fp8(const unsigned char* k_codes, const unsigned char* v_codes,
                                         const float* k_scales, const float* v_scales, const int* table,
                                         int block_size, int kv_heads, int head_dim, bf16* k_out, bf16* v_out) {
    int p = blockIdx.x;
    size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
    int width = kv_heads * head_dim;
    KvFp8 kc{k_codes, k_scales, width, head_dim, kv_heads}, vc{v_codes, v_scales, width, head_dim, kv_heads};
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_out[(size_t)p * width + i] = f2bf(kc.at(slot, i / head_dim, i % head_dim));
        v_out[(size_t)p * width + i] = f2bf(vc.at(slot, i / head_dim, i % head_dim));
    }
}
