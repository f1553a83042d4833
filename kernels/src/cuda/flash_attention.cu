// Fused causal attention of a long prompt (FlashAttention-2 style): no score matrix in memory.
//
// Inputs: f32 queries q[rows, heads · D] (query r at position pos0 + r), contiguous bf16 keys and values
// k[keys, k_stride], v[keys, v_stride] with KV head g at columns g · D (the rows `gather_kv` writes from
// the paged cache; keys = pos0 + rows at least). Output: bf16 out[rows, heads · D].
//
// GQA: the `group` query heads of one KV head are packed into the tile's rows: packed row m is query
// row m / group, head g · group + m % group, so every K/V tile a block loads serves the whole group.
// Grid: (ceil(rows · group / (16 · W)), kv_heads), heaviest (last) tiles first. Block: W warps (4 or 8),
// each 16 packed rows (more warps: fewer K/V tile loads per query row, one block per SM instead of two); keys in tiles of 64 through shared memory (cp.async: K of the next tile loads during this
// tile's P·V, V of the next during its Q·Kᵀ); mma.sync m16n8k16 bf16 with f32 accumulators; online
// softmax in base 2 with the scale folded in; P rounded to bf16 for P·V (as the GEMM path's P).
// Causal (and sliding-window) masking only on the tiles that cross a row's limits. Needs D % 16 == 0,
// 16-byte aligned K/V rows (strides % 8 == 0) and q rows of whole float4s.
//
// Its own NVRTC module per head dim (`FA_HEAD_DIM`, defined before this file), compiled when a model
// first needs it: the fully unrolled tiles take NVRTC seconds that every start would pay otherwise.
#define FA_BN 64

// D = A·B + D for one 16 × 8 tile (bf16 in, f32 accumulators; sm_80 and later).
__device__ __forceinline__ void fa_mma(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned fa_smem(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// 16 bytes global → shared without registers; `valid` false zero-fills (nothing is read).
__device__ __forceinline__ void fa_cp16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_smem(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void fa_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void fa_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// Four 8 × 8 bf16 matrices, transposed: the B operand of P·V from V's [key][dim] rows.
__device__ __forceinline__ void fa_ldmatrix_t4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem(p)));
}
// (lo, hi) → bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned fa_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float fa_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Issues the cp.async copies of key tile `j` (rows past `kend` zero-filled) of K or V into `dst`.
template <int D, int W>
__device__ __forceinline__ void fa_load_tile(bf16* dst, const bf16* __restrict__ src, int stride, int col0,
                                             int j, int kend) {
    constexpr int LD = D + 8, VEC = D / 8;
    for (int i = threadIdx.x; i < FA_BN * VEC; i += 32 * W) {
        const int r = i / VEC, c = (i % VEC) * 8, key = j * FA_BN + r;
        const bool valid = key < kend;
        fa_cp16(dst + r * LD + c, src + (size_t)(valid ? key : 0) * stride + col0 + c, valid);
    }
}

template <int D, int W>
__device__ __forceinline__ void flash_prefill_body(const float* __restrict__ q, int stride,
                                                   const bf16* __restrict__ k, int k_stride,
                                                   const bf16* __restrict__ v, int v_stride,
                                                   bf16* __restrict__ out, int rows, int pos0, int group,
                                                   float scale_log2, int window) {
    constexpr int LD = D + 8;  // padded rows: fragment loads and ldmatrix rows hit distinct banks
    constexpr int KS = D / 16, NT = FA_BN / 8, DT = D / 8, BM = 16 * W;
    static_assert(BM <= 2 * FA_BN, "the Q tile is staged in the K and V tiles' space");
    __shared__ __align__(16) bf16 smem[2 * FA_BN * LD];  // K tile, V tile; first the Q tile
    bf16* sK = smem;
    bf16* sV = smem + FA_BN * LD;
    const int kvh = blockIdx.y;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int packed = rows * group;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    // keys this tile needs: up to its last query's position, from its first query's window start
    const int m_last = min(m0 + BM, packed) - 1;
    const int kend = pos0 + m_last / group + 1;
    const int kstart = window > 0 ? max(0, pos0 + m0 / group - window + 1) : 0;
    const int j0 = kstart / FA_BN, j1 = (kend + FA_BN - 1) / FA_BN;
    const int col0 = kvh * D;

    // Q tile (f32 → bf16) through shared memory into registers, then the first K and V tiles
    for (int i = tid; i < BM * (D / 4); i += 32 * W) {
        const int r = i / (D / 4), c = (i % (D / 4)) * 4, m = m0 + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (m < packed) {
            const int head = kvh * group + m % group;
            x = *(const float4*)(q + (size_t)(m / group) * stride + head * D + c);
        }
        *(uint2*)(smem + r * LD + c) = make_uint2(fa_pack(x.x, x.y), fa_pack(x.z, x.w));
    }
    __syncthreads();
    unsigned qf[KS][4];
    for (int ks = 0; ks < KS; ks++) {
        const bf16* p = smem + (warp * 16 + g) * LD + ks * 16 + t * 2;
        qf[ks][0] = *(const unsigned*)p;
        qf[ks][1] = *(const unsigned*)(p + 8 * LD);
        qf[ks][2] = *(const unsigned*)(p + 8);
        qf[ks][3] = *(const unsigned*)(p + 8 * LD + 8);
    }
    __syncthreads();
    fa_load_tile<D, W>(sK, k, k_stride, col0, j0, kend);
    fa_commit();
    fa_load_tile<D, W>(sV, v, v_stride, col0, j0, kend);
    fa_commit();

    // this thread's two packed rows (g and g + 8 of the warp's 16) and their query positions
    const int ma = m0 + warp * 16 + g, mb = ma + 8;
    const int pa = pos0 + ma / group, pb = pos0 + mb / group;
    // first and last query positions of the block, for the tile-uniform "needs a mask" test
    const int pmin = pos0 + m0 / group, pmax = kend - 1;
    float o[DT][4];
    for (int d = 0; d < DT; d++)
        for (int e = 0; e < 4; e++) o[d][e] = 0.f;
    float mxa = -INFINITY, mxb = -INFINITY, la = 0.f, lb = 0.f;

    for (int j = j0; j < j1; j++) {
        fa_wait<1>();
        __syncthreads();  // K of tile j in shared memory
        float s[NT][4];
        for (int n = 0; n < NT; n++) {
            for (int e = 0; e < 4; e++) s[n][e] = 0.f;
            for (int ks = 0; ks < KS; ks++) {
                const bf16* p = sK + (n * 8 + g) * LD + ks * 16 + t * 2;
                const unsigned b[2] = {*(const unsigned*)p, *(const unsigned*)(p + 8)};
                fa_mma(s[n], qf[ks], b);
            }
        }
        const int key0 = j * FA_BN;
        const bool edge = key0 + FA_BN - 1 > pmin || (window > 0 && key0 < pmax - window + 1);
        for (int n = 0; n < NT; n++) {
            for (int e = 0; e < 4; e++) {
                float x = s[n][e] * scale_log2;
                if (edge) {
                    const int key = key0 + n * 8 + t * 2 + (e & 1), pos = e < 2 ? pa : pb;
                    if (key > pos || (window > 0 && key < pos - window + 1)) x = -INFINITY;
                }
                s[n][e] = x;
            }
        }
        // online softmax: new row maxima over the quad of threads sharing a row
        float ta = -INFINITY, tb = -INFINITY;
        for (int n = 0; n < NT; n++) {
            ta = fmaxf(ta, fmaxf(s[n][0], s[n][1]));
            tb = fmaxf(tb, fmaxf(s[n][2], s[n][3]));
        }
        for (int off = 1; off < 4; off <<= 1) {
            ta = fmaxf(ta, __shfl_xor_sync(0xffffffff, ta, off));
            tb = fmaxf(tb, __shfl_xor_sync(0xffffffff, tb, off));
        }
        const float na = fmaxf(mxa, ta), nb = fmaxf(mxb, tb);
        // a row with every key so far masked keeps base 0 (exp2(-inf) = 0, never inf - inf)
        const float ba = na == -INFINITY ? 0.f : na, bb = nb == -INFINITY ? 0.f : nb;
        const float ca = fa_exp2(mxa - ba), cb = fa_exp2(mxb - bb);
        mxa = na;
        mxb = nb;
        float sa = 0.f, sb = 0.f;
        for (int n = 0; n < NT; n++) {
            s[n][0] = fa_exp2(s[n][0] - ba);
            s[n][1] = fa_exp2(s[n][1] - ba);
            s[n][2] = fa_exp2(s[n][2] - bb);
            s[n][3] = fa_exp2(s[n][3] - bb);
            sa += s[n][0] + s[n][1];
            sb += s[n][2] + s[n][3];
        }
        la = la * ca + sa;  // this thread's share of the row sum (summed over the quad at the end)
        lb = lb * cb + sb;
        for (int d = 0; d < DT; d++) {
            o[d][0] *= ca;
            o[d][1] *= ca;
            o[d][2] *= cb;
            o[d][3] *= cb;
        }

        fa_wait<0>();
        __syncthreads();  // V of tile j in shared memory; every warp is done with sK
        if (j + 1 < j1) fa_load_tile<D, W>(sK, k, k_stride, col0, j + 1, kend);
        fa_commit();
        for (int kk = 0; kk < FA_BN / 16; kk++) {
            // the S accumulators of keys kk·16.. are P's A fragment as they lie
            const unsigned a[4] = {fa_pack(s[2 * kk][0], s[2 * kk][1]), fa_pack(s[2 * kk][2], s[2 * kk][3]),
                                   fa_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                   fa_pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            for (int d2 = 0; d2 < D / 16; d2++) {
                unsigned b[4];
                fa_ldmatrix_t4(b, sV + key * LD + d2 * 16 + (lane >> 4) * 8);
                fa_mma(o[2 * d2], a, b);
                fa_mma(o[2 * d2 + 1], a, b + 2);
            }
        }
        __syncthreads();  // every warp is done with sV
        if (j + 1 < j1) fa_load_tile<D, W>(sV, v, v_stride, col0, j + 1, kend);
        fa_commit();
    }

    for (int off = 1; off < 4; off <<= 1) {
        la += __shfl_xor_sync(0xffffffff, la, off);
        lb += __shfl_xor_sync(0xffffffff, lb, off);
    }
    const float ia = la > 0.f ? 1.f / la : 0.f, ib = lb > 0.f ? 1.f / lb : 0.f;
    for (int half = 0; half < 2; half++) {
        const int m = half ? mb : ma;
        if (m >= packed) continue;
        const float inv = half ? ib : ia;
        bf16* dst = out + (size_t)(m / group) * stride + (kvh * group + m % group) * D + t * 2;
        for (int d = 0; d < DT; d++)
            *(unsigned*)(dst + d * 8) = fa_pack(o[d][2 * half] * inv, o[d][2 * half + 1] * inv);
    }
}

#define FA_ENTRY(D, W, NAME)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                     \
        NAME(const float* __restrict__ q, int stride, const bf16* __restrict__ k, int k_stride,              \
             const bf16* __restrict__ v, int v_stride, bf16* __restrict__ out, int rows, int pos0, int group,  \
             float scale_log2, int window) {                                                                  \
        flash_prefill_body<D, W>(q, stride, k, k_stride, v, v_stride, out, rows, pos0, group, scale_log2,    \
                                 window);                                                                    \
    }
#ifndef FA_HEAD_DIM
#error "define FA_HEAD_DIM, the head dim the module is built for"
#endif
FA_ENTRY(FA_HEAD_DIM, 4, flash_prefill_w4)
FA_ENTRY(FA_HEAD_DIM, 8, flash_prefill_w8)
