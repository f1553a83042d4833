
// ---- Routed experts of a small step read from the device routing (no host round trip) ----
// A layer's router leaves its top-k ids and weights on the device ([n, k], pair p = row * k + slot).
// A per-layer table holds each expert's gate_up ([2I, H]) and down ([H, I]) bf16 weight addresses, 0
// where the expert is not resident (computed elsewhere: the CPU's DRAM experts). Four launches:
//   routed_group:   the resident pairs grouped by expert (ascending expert, then pair), so that each
//                   expert's weights are read once per step whatever the number of rows that chose it;
//   routed_gate_up: per (expert group, output row j): gate_j and up_j of every member row, the gated
//                   activation, rounded to bf16 into act[p, j];
//   routed_down:    per (expert group, output row j): down_j · act[p] into y[p, j] (f32);
//   routed_combine: x[r] += sum of w[p] * y[p] over the row's resident pairs in ascending expert
//                   order (the host-planned combine's order): deterministic, no atomics.
// Grids are sized for the most groups a step can have (min(experts, n·k)); blocks past the step's
// group count return at once, so the launches replay unchanged from a CUDA graph.

#define ROUTED_WARPS 8
#define ROUTED_CHUNK 8   // member rows one warp accumulates at a time
#define ROUTED_MAX_PAIRS 1024

// Header of the group buffer: [0] group count, [1 .. 1+nk] expert of group u, [1+nk .. 2+2nk] group
// offsets into the member list (CSR), [2+2nk .. 2+3nk] member pairs.
__device__ __forceinline__ const int* routed_experts(const int* g) { return g + 1; }
__device__ __forceinline__ const int* routed_offsets(const int* g, int nk) { return g + 1 + nk; }
__device__ __forceinline__ const int* routed_members(const int* g, int nk) { return g + 2 + 2 * nk; }

// One block (blockDim ≥ 32), nk ≤ ROUTED_MAX_PAIRS.
extern "C" __global__ void routed_group(const int* ids, int nk, int experts, const unsigned long long* table,
                                        int* groups) {
    __shared__ int expert[ROUTED_MAX_PAIRS];
    __shared__ unsigned char first[ROUTED_MAX_PAIRS];
    __shared__ int count;
    if (threadIdx.x == 0) count = 0;
    for (int p = threadIdx.x; p < nk; p += blockDim.x) {
        int e = ids[p];
        expert[p] = (e >= 0 && e < experts && table[e] != 0ull) ? e : -1;
    }
    __syncthreads();
    int* uexp = groups + 1;
    int* uoff = groups + 1 + nk;
    int* members = groups + 2 + 2 * nk;
    for (int p = threadIdx.x; p < nk; p += blockDim.x) {
        int e = expert[p];
        unsigned char f = 0;
        if (e >= 0) {
            f = 1;
            int rank = 0;
            for (int q = 0; q < nk; ++q) {
                int eq = expert[q];
                if (eq < 0) continue;
                if (eq < e || (eq == e && q < p)) ++rank;
                if (eq == e && q < p) f = 0;
            }
            members[rank] = p;
        }
        first[p] = f;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < nk; p += blockDim.x) {
        if (!first[p]) continue;
        int e = expert[p], u = 0, off = 0;
        for (int q = 0; q < nk; ++q) {
            int eq = expert[q];
            if (eq < 0 || eq >= e) continue;
            ++off;
            u += first[q];
        }
        uexp[u] = e;
        uoff[u] = off;
        atomicAdd(&count, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int q = 0; q < nk; ++q) total += expert[q] >= 0;
        groups[0] = count;
        uoff[count] = total;
    }
}

__device__ __forceinline__ void bf16x8(uint4 v, float* f) {
    unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ float routed_act(float g, float u, int act, float limit, float* up) {
    g = fminf(g, limit);
    *up = fmaxf(fminf(u, limit), -limit);
    return act == 1   ? 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)))
           : act == 2 ? fmaxf(g, 0.f)
                      : g / (1.f + __expf(-g));
}

// grid (ceil(inter / ROUTED_WARPS), most groups), block 32 * ROUTED_WARPS. hidden % 8 == 0.
// x: the layer's normalised rows [n, hidden] (bf16); act [nk, inter] (bf16). act as `gated_mul`.
extern "C" __global__ void routed_gate_up(const int* groups, int nk, int k, const unsigned long long* table,
                                          const bf16* x, int hidden, int inter, int act, float limit,
                                          bf16* out) {
    int u = blockIdx.y;
    if (u >= groups[0]) return;
    int j = blockIdx.x * ROUTED_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (j >= inter) return;
    int e = routed_experts(groups)[u];
    int m0 = routed_offsets(groups, nk)[u], m1 = routed_offsets(groups, nk)[u + 1];
    const int* members = routed_members(groups, nk);
    const bf16* w = (const bf16*)table[e];
    const uint4* wg = (const uint4*)(w + (size_t)j * hidden);
    const uint4* wu = (const uint4*)(w + (size_t)(inter + j) * hidden);
    for (int c0 = m0; c0 < m1; c0 += ROUTED_CHUNK) {
        int cn = min(ROUTED_CHUNK, m1 - c0);
        const uint4* xr[ROUTED_CHUNK];
        float ag[ROUTED_CHUNK], au[ROUTED_CHUNK];
#pragma unroll
        for (int t = 0; t < ROUTED_CHUNK; ++t) {
            int p = members[c0 + min(t, cn - 1)];
            xr[t] = (const uint4*)(x + (size_t)(p / k) * hidden);
            ag[t] = 0.f;
            au[t] = 0.f;
        }
        for (int c = lane; c < hidden / 8; c += WARP) {
            float g8[8], u8[8];
            bf16x8(wg[c], g8);
            bf16x8(wu[c], u8);
#pragma unroll
            for (int t = 0; t < ROUTED_CHUNK; ++t) {
                if (t >= cn) break;
                float x8[8];
                bf16x8(xr[t][c], x8);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    ag[t] += g8[i] * x8[i];
                    au[t] += u8[i] * x8[i];
                }
            }
        }
#pragma unroll
        for (int t = 0; t < ROUTED_CHUNK; ++t) {
            if (t >= cn) break;
            float g = warp_sum(ag[t]), up = warp_sum(au[t]);
            if (lane == 0) {
                float uc;
                float a = routed_act(g, up, act, limit, &uc);
                out[(size_t)members[c0 + t] * inter + j] = f2bf(a * uc);
            }
        }
    }
}

// grid (ceil(hidden / ROUTED_WARPS), most groups), block 32 * ROUTED_WARPS. inter % 8 == 0.
// act [nk, inter] (bf16) -> y [nk, hidden] (f32), rows of resident pairs only.
extern "C" __global__ void routed_down(const int* groups, int nk, const unsigned long long* table, int experts,
                                       const bf16* act, int hidden, int inter, float* y) {
    int u = blockIdx.y;
    if (u >= groups[0]) return;
    int j = blockIdx.x * ROUTED_WARPS + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (j >= hidden) return;
    int e = routed_experts(groups)[u];
    int m0 = routed_offsets(groups, nk)[u], m1 = routed_offsets(groups, nk)[u + 1];
    const int* members = routed_members(groups, nk);
    const uint4* wd = (const uint4*)((const bf16*)table[experts + e] + (size_t)j * inter);
    for (int c0 = m0; c0 < m1; c0 += ROUTED_CHUNK) {
        int cn = min(ROUTED_CHUNK, m1 - c0);
        const uint4* ar[ROUTED_CHUNK];
        float acc[ROUTED_CHUNK];
#pragma unroll
        for (int t = 0; t < ROUTED_CHUNK; ++t) {
            ar[t] = (const uint4*)(act + (size_t)members[c0 + min(t, cn - 1)] * inter);
            acc[t] = 0.f;
        }
        for (int c = lane; c < inter / 8; c += WARP) {
            float w8[8];
            bf16x8(wd[c], w8);
#pragma unroll
            for (int t = 0; t < ROUTED_CHUNK; ++t) {
                if (t >= cn) break;
                float a8[8];
                bf16x8(ar[t][c], a8);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[t] += w8[i] * a8[i];
            }
        }
#pragma unroll
        for (int t = 0; t < ROUTED_CHUNK; ++t) {
            if (t >= cn) break;
            float s = warp_sum(acc[t]);
            if (lane == 0) y[(size_t)members[c0 + t] * hidden + j] = s;
        }
    }
}

// grid (n, ceil(hidden / 256)), block 256: x[r, j] += sum of w[p] * y[p, j] over the row's pairs p whose
// expert is resident, taken in ascending expert order and summed with fused multiply-adds from 0 before
// the one add into x: exactly the order of the host-planned path's `scatter_add_weighted` (a token's
// GPU rows are grouped by ascending expert), so both paths round the same. Another order moves x by an
// ulp, which the next norm's bf16 rounding can turn into a whole bf16 step of one element (a 4e-3
// change of a small model's logits). Top-k ids of a row are distinct. Deterministic, no atomics.
extern "C" __global__ void routed_combine(const int* ids, const float* w, int k, int experts,
                                          const unsigned long long* table, const float* y, int hidden, float* x) {
    int r = blockIdx.x, j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= hidden) return;
    float s = 0.f;
    int prev = -1;
    for (int taken = 0; taken < k; ++taken) {
        int next = experts, at = -1;
        for (int slot = 0; slot < k; ++slot) {
            int p = r * k + slot, e = ids[p];
            if (e <= prev || e >= next || table[e] == 0ull) continue;
            next = e;
            at = p;
        }
        if (at < 0) break;
        s = fmaf(w[at], y[(size_t)at * hidden + j], s);
        prev = next;
    }
    x[(size_t)r * hidden + j] += s;
}
