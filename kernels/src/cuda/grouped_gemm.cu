// Grouped expert GEMM: y_i[rows_i, m] = x_i[rows_i, k] · w_iᵀ for every item i of a phase in ONE launch
// (bf16 in, f32 accumulation and out), whatever each item's row count. cuBLAS's grouped call does not
// take bf16 inputs with f32 outputs, and its batched call needs one launch (and one heuristic lookup)
// per distinct row count: one per expert in a long prompt (`grouped.rs`).
//
// Table (device, u64): the items' weight, input and output addresses, then their row counts (n of each),
// then one entry per 64-row tile of output rows: item << 32 | first row. Grid: (tiles, ceil(m / 64)).
// Block: 128 threads, four warps in 2 × 2, each warp a 32 × 32 part of a 64 × 64 output tile; k in steps
// of 32 through shared memory (rows padded by 8 bf16: the fragment loads hit 32 distinct banks);
// mma.sync m16n8k16 (bf16 in, f32 accumulators; sm_80 and later). Needs k % 8 == 0 (16-byte loads) and
// m even (float2 stores); rows past an item's count and columns past m are zero-filled and not stored.
#define GG_BM 64
#define GG_BN 64
#define GG_BK 32
#define GG_LD (GG_BK + 8)

// D = A·B + D for one 16 × 8 tile: a holds the thread's four A registers, b its two B registers.
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

extern "C" __global__ void grouped_gemm_bf16(
    const unsigned long long* __restrict__ table, int n, int m, int k) {
    __shared__ __align__(16) bf16 As[GG_BM * GG_LD];
    __shared__ __align__(16) bf16 Bs[GG_BN * GG_LD];
    const unsigned long long tile = table[4 * (size_t)n + blockIdx.x];
    const int item = (int)(tile >> 32);
    const int row0 = (int)(tile & 0xffffffffull);
    const bf16* __restrict__ w = (const bf16*)table[item];
    const bf16* __restrict__ x = (const bf16*)table[n + item];
    float* __restrict__ y = (float*)table[2 * n + item];
    const int rows = (int)table[3 * n + item];
    const int col0 = blockIdx.y * GG_BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int g = lane >> 2, t = lane & 3;
    float acc[2][4][4];
    for (int mi = 0; mi < 2; mi++)
        for (int ni = 0; ni < 4; ni++)
            for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.f;
    // The next step's operands are loaded into registers while this step's are multiplied (global
    // latency hidden behind the MMAs); 64 rows × 32 values = 256 vectors of 8 bf16 per operand, two
    // per thread: vector v is row v / 4, values (v % 4) · 8.
    uint4 ra[2], rb[2];
    auto load = [&](int k0) {
        for (int i = 0; i < 2; i++) {
            const int v = tid + i * 128, r = v >> 2, c = (v & 3) * 8;
            ra[i] = make_uint4(0, 0, 0, 0);
            rb[i] = make_uint4(0, 0, 0, 0);
            if (row0 + r < rows && k0 + c < k) ra[i] = *(const uint4*)(x + (size_t)(row0 + r) * k + k0 + c);
            if (col0 + r < m && k0 + c < k) rb[i] = *(const uint4*)(w + (size_t)(col0 + r) * k + k0 + c);
        }
    };
    load(0);
    for (int k0 = 0; k0 < k; k0 += GG_BK) {
        for (int i = 0; i < 2; i++) {
            const int v = tid + i * 128, r = v >> 2, c = (v & 3) * 8;
            *(uint4*)(As + r * GG_LD + c) = ra[i];
            *(uint4*)(Bs + r * GG_LD + c) = rb[i];
        }
        __syncthreads();
        if (k0 + GG_BK < k) load(k0 + GG_BK);
        for (int ks = 0; ks < GG_BK; ks += 16) {
            unsigned af[2][4], bfr[4][2];
            for (int mi = 0; mi < 2; mi++) {
                const bf16* p = As + (wm * 32 + mi * 16 + g) * GG_LD + ks + t * 2;
                af[mi][0] = *(const unsigned*)p;
                af[mi][1] = *(const unsigned*)(p + 8 * GG_LD);
                af[mi][2] = *(const unsigned*)(p + 8);
                af[mi][3] = *(const unsigned*)(p + 8 * GG_LD + 8);
            }
            for (int ni = 0; ni < 4; ni++) {
                const bf16* p = Bs + (wn * 32 + ni * 8 + g) * GG_LD + ks + t * 2;
                bfr[ni][0] = *(const unsigned*)p;
                bfr[ni][1] = *(const unsigned*)(p + 8);
            }
            for (int mi = 0; mi < 2; mi++)
                for (int ni = 0; ni < 4; ni++) mma_bf16_16816(acc[mi][ni], af[mi], bfr[ni]);
        }
        __syncthreads();
    }
    for (int mi = 0; mi < 2; mi++) {
        for (int ni = 0; ni < 4; ni++) {
            const int r = row0 + wm * 32 + mi * 16 + g;
            const int c = col0 + wn * 32 + ni * 8 + t * 2;
            if (c >= m) continue;
            if (r < rows) *(float2*)(y + (size_t)r * m + c) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
            if (r + 8 < rows)
                *(float2*)(y + (size_t)(r + 8) * m + c) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
        }
    }
}
