// ---- 8-bit KV cache (`--kv-cache-dtype int8|fp8`) ----
// Rows of 8-bit codes with one f32 scale per `group` consecutive values of a row (32 for head widths that
// are multiples of 32; a group never straddles two heads), read back as value(code) * scale:
// - int8 (code 1): scale = amax / 127, code = round(value / scale) in -127..127 (llama.cpp's q8_0:
//   blocks of 32): the error is at most scale / 2, uniform over the group.
// - E4M3 (code 0): scale = amax / 448, code = e4m3(value / scale): 3 mantissa bits, ~6 % relative
//   error per value whatever the scale (vLLM's fp8 cache, with per-row scales instead of calibrated
//   per-tensor ones).
// Half the bytes of bf16 rows plus 4 bytes per group; no calibration.

#define KV_CODE_E4M3 0
#define KV_CODE_INT8 1

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

// Largest code magnitude of a format (the scale maps a row's amax onto it).
__device__ __forceinline__ float kv_code_max(int code) { return code == KV_CODE_INT8 ? 127.f : 448.f; }

// `x` (already divided by the scale) as a code of the format.
__device__ __forceinline__ unsigned char kv_encode(float x, int code) {
    if (code == KV_CODE_INT8) return (unsigned char)(signed char)__float2int_rn(fminf(fmaxf(x, -127.f), 127.f));
    return f32_to_e4m3(x);
}

__device__ __forceinline__ float kv_decode(unsigned char c, int code) {
    return code == KV_CODE_INT8 ? (float)(signed char)c : e4m3_to_f32(c);
}

struct KvQ8 {
    const unsigned char* codes;
    const float* scales;  // [rows, width / group]
    int width, head_dim, group, code;
    __device__ __forceinline__ float at(size_t slot, int kvh, int i) const {
        int c = kvh * head_dim + i;
        return kv_decode(codes[slot * width + c], code) * scales[slot * (width / group) + c / group];
    }
};

// Writes each token's k and v rows ([tokens, width] f32) into cache row slot_of_token[t] as codes of
// format `code` and one scale per `group` values (group divides width). One block per token, one warp
// per group at a time.
extern "C" __global__ void kv_append_q8(const float* k, const float* v, int width, int group, int code,
                                        unsigned char* k_codes, unsigned char* v_codes, float* k_scales,
                                        float* v_scales, const int* slot_of_token) {
    int t = blockIdx.x, lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    size_t slot = (size_t)slot_of_token[t];
    int groups = width / group;
    for (int job = threadIdx.x / WARP; job < 2 * groups; job += warps) {
        int g = job % groups;
        const float* src = (job < groups ? k : v) + (size_t)t * width + (size_t)g * group;
        unsigned char* dst = (job < groups ? k_codes : v_codes) + slot * width + (size_t)g * group;
        float* sc = (job < groups ? k_scales : v_scales) + slot * groups + g;
        float amax = 0.f;
        for (int i = lane; i < group; i += WARP) amax = fmaxf(amax, fabsf(src[i]));
        amax = warp_max(amax);
        float s = amax > 0.f ? amax / kv_code_max(code) : 1.f;
        for (int i = lane; i < group; i += WARP) dst[i] = kv_encode(src[i] / s, code);
        if (lane == 0) *sc = s;
    }
}

extern "C" __global__ void paged_attention_q8(const float* q, const unsigned char* k_codes,
                                              const unsigned char* v_codes, const float* k_scales,
                                              const float* v_scales, int group, int code, const int* block_tables,
                                              int max_blocks, const int* seq_of_token, const int* pos_of_token,
                                              int heads, int kv_heads, int head_dim, int block_size, float scale,
                                              int window, int row0, bf16* out) {
    int width = kv_heads * head_dim;
    paged_attention_rows(q, KvQ8{k_codes, k_scales, width, head_dim, group, code},
                         KvQ8{v_codes, v_scales, width, head_dim, group, code}, block_tables, max_blocks,
                         seq_of_token, pos_of_token, heads, kv_heads, head_dim, block_size, scale, window, row0,
                         out);
}

// One sequence's cached rows 0..len (8-bit) -> contiguous bf16 [len, width] (long prefill's GEMM inputs).
// (The row is read as one "head" of `width` values: `at` only needs the value's index in the row.)
extern "C" __global__ void gather_kv_q8(const unsigned char* k_codes, const unsigned char* v_codes,
                                        const float* k_scales, const float* v_scales, int group, int code,
                                        const int* table, int block_size, int width, bf16* k_out, bf16* v_out) {
    int p = blockIdx.x;
    size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
    KvQ8 kc{k_codes, k_scales, width, width, group, code}, vc{v_codes, v_scales, width, width, group, code};
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        k_out[(size_t)p * width + i] = f2bf(kc.at(slot, 0, i));
        v_out[(size_t)p * width + i] = f2bf(vc.at(slot, 0, i));
    }
}
