// ---- The decode segment's fused kernels (a layer's work between two CPU expert calls at batch 1..8) ----
// Appended to the start-up module (uses common.cuh's reductions, kernels.cu's norm_rope_head,
// router_topk_row and KvBf16, dense_quant.cu's dot8 / gemv_store, kv_q8.cu's KvQ8). At decode sizes
// every op of the segment is bound by its launch and its memory latency, not by bandwidth (the ~40 MB
// a Qwen3-30B-A3B layer reads take ~10 µs at HBM speed), so these kernels cut launches and dependent
// memory round trips: q/k/v as one GEMV launch, q/k norm + RoPE + the cache append as one, decode
// attention spread over warps, and the router's GEMV with its top-k.

// y_m[t, r] (=|+=) x[t] . W_m[r] (+ b_m[r]) for up to three bf16 matrices W_m ([out_m, in]) sharing the
// input x (bf16 [n, in], n <= GEMV_MAX_TOKENS) and their optional f32 biases b_m (null: none; added after
// the sum, as add_bias does, so the values are those of the GEMV followed by add_bias): output rows of
// all matrices are numbered in one range, each row taken by `split` warps (gemv_bf16_rows; 1 for
// gemv_bf16_norm); each lane takes 8 consecutive inputs (one 16-byte load) per step, so a warp reads 512
// contiguous bytes and each lane keeps up to GEMV_LOADS loads in flight. in % 8 == 0, 16-byte aligned
// rows. A block takes rows_per_block = 8 / split rows, then strides over the rest by the grid's rows
// (a grid smaller than the rows is resident at once and pays its start, the norm in gemv_bf16_norm,
// once per block, not once per wave).
// grid: at most ceil((out0 + out1 + out2) * split / 8); block: 256.
#define GEMV_LOADS 8

// The matrices of one gemv_bf16 launch: weights, outputs, output rows and biases (null: none).
struct GemvMats {
    const bf16* w[3];
    float* y[3];
    int out[3];
    const float* b[3];
};

// The weight row, output and bias of global output row r of a gemv_bf16 launch (w null: past the last
// row).
struct GemvRow {
    const bf16* w;
    float* y;
    int out, r;
    const float* b;
};
__device__ __forceinline__ GemvRow gemv_row(int r, const GemvMats& m, int in) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        if (r < m.out[i]) return {m.w[i] + (size_t)r * in, m.y[i], m.out[i], r, m.b[i]};
        r -= m.out[i];
    }
    return {nullptr, nullptr, 0, 0, nullptr};
}

// Output element i (row r of its matrix) of a gemv_bf16 launch from its sum v: stored or accumulated,
// then the row's bias added (the order of a GEMV followed by add_bias).
__device__ __forceinline__ void gemv_put(const GemvRow& row, size_t i, float v, int accumulate) {
    float y = accumulate ? row.y[i] + v : v;
    if (row.b) y += row.b[row.r];
    row.y[i] = y;
}

// One chunk of a lane's weight loads: GEMV_LOADS 16-byte loads from input c0 on, WARP * 8 inputs apart,
// all issued before any is used (the kernel is bound by how many loads are in flight).
__device__ __forceinline__ void gemv_load(const bf16* w, int in, int c0, uint4* q) {
    const uint4* wr = (const uint4*)w;
#pragma unroll
    for (int j = 0; j < GEMV_LOADS; ++j) {
        int c = c0 + j * WARP * 8;
        if (c < in) q[j] = wr[c / 8];
    }
}

// The chunk's dot products with the NT <= GEMV_MAX_TOKENS rows of x (bf16 [n, in], global or shared
// memory; rows from n on skipped) into acc: per row the sum of dot8's, in its order.
template <int NT>
__device__ __forceinline__ void gemv_dot(const uint4* q, const bf16* x, int in, int n, int c0, float* acc) {
#pragma unroll
    for (int j = 0; j < GEMV_LOADS; ++j) {
        int c = c0 + j * WARP * 8;
        if (c >= in) break;
        unsigned int words[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < n) {
                uint4 xv = *(const uint4*)(x + (size_t)t * in + c);
                unsigned int xs[4] = {xv.x, xv.y, xv.z, xv.w};
                float p = 0.f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    p += __uint_as_float(words[i] << 16) * __uint_as_float(xs[i] << 16);
                    p += __uint_as_float(words[i] & 0xffff0000u) * __uint_as_float(xs[i] & 0xffff0000u);
                }
                acc[t] += p;
            }
        }
    }
}

// gemv_store for NT accumulators, with the row's bias.
template <int NT>
__device__ __forceinline__ void gemv_store_rows(const float* acc, int n, const GemvRow& row, int accumulate) {
    int lane = threadIdx.x % WARP;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < n) {
            float v = warp_sum(acc[t]);
            if (lane == 0) gemv_put(row, (size_t)t * row.out + row.r, v, accumulate);
        }
    }
}

// The GEMV kernels come in one entry per bound on the rows (1, 2, GEMV_MAX_TOKENS): the registers a
// kernel uses are those of its largest row count (8 accumulators and 8 rows' loads: ~100 registers,
// two 256-thread blocks per SM). The 1- and 2-row entries are held to GEMV_FEW_ROWS_BLOCKS blocks per
// SM: 64 registers, no spills with the next row's loads in flight across a row's reduction (at 48
// registers, 5 blocks, they spilled: a spilled load target waits for its DRAM round trip); each of the
// 528 resident blocks keeps 8 rows' 4 KB of loads going.
#define GEMV_FEW_ROWS_BLOCKS 4
// The norm-folding entries also keep their first weight loads and the row's elements in registers
// across the norm: 3 blocks per SM (80 registers, no spills; 64 spilled).
#define GEMV_NORM_FEW_ROWS_BLOCKS 3
// Warps of a gemv_bf16 block (its launch's block: 256 threads).
#define GEMV_MAX_WARPS 8
// Inputs a warp's GEMV_LOADS loads per lane cover: one chunk of a row.
#define GEMV_CHUNK (GEMV_LOADS * WARP * 8)

// The GEMV of gemv_bf16 with each output row split over `split` warps of the block (1, 2, 4 or 8:
// warp w takes row w / split, chunks w % split, w % split + split, ...; their sums added in that
// order through shared memory), so that a row of several chunks is read in one round of loads. With
// `loaded`, q holds the first chunk of the warp's first row already (gemv_bf16_norm issues it before
// its norm); a block striding over rows issues each next row's first chunk before reducing the
// current one. Inlined, so q stays in registers.
template <int NT>
__device__ __forceinline__ void gemv_rows(const bf16* x, int n, int in, int accumulate, int split, const GemvMats& m,
                                          uint4 (&q)[GEMV_LOADS], bool loaded) {
    __shared__ float parts[GEMV_MAX_WARPS][NT];
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, part = warp % split;
    int per_block = blockDim.x / WARP / split, total = m.out[0] + m.out[1] + m.out[2];
    for (int r0 = blockIdx.x * per_block; r0 < total; r0 += gridDim.x * per_block) {
        GemvRow row = gemv_row(r0 + warp / split, m, in);
        if (split == 1 && !row.w) return;
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t] = 0.f;
        if (row.w) {
            for (int c0 = lane * 8 + part * GEMV_CHUNK; c0 < in; c0 += split * GEMV_CHUNK) {
                if (!loaded) gemv_load(row.w, in, c0, q);
                loaded = false;
                gemv_dot<NT>(q, x, in, n, c0, acc);
            }
        }
        // the warp's next row's first chunk in flight while this row's sums are reduced and stored (a
        // block striding over rows keeps its loads going instead of draining them at every row)
        {
            int c0 = lane * 8 + part * GEMV_CHUNK, rn = r0 + gridDim.x * per_block;
            const bf16* next = rn < total && c0 < in ? gemv_row(rn + warp / split, m, in).w : nullptr;
            if (next) gemv_load(next, in, c0, q);
            loaded = next != nullptr;
        }
        if (split == 1) {
            gemv_store_rows<NT>(acc, n, row, accumulate);
            continue;
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < n) {
                float v = warp_sum(acc[t]);
                if (lane == 0) parts[warp][t] = v;
            }
        }
        __syncthreads();
        // the row's first warp adds its warps' sums: lane t for row t
        if (row.w && part == 0 && lane < n) {
            float v = 0.f;
            for (int p = 0; p < split; ++p) v += parts[warp + p][lane];
            gemv_put(row, (size_t)lane * row.out + row.r, v, accumulate);
        }
        // (the next rows' sums overwrite parts)
        __syncthreads();
    }
}

template <int NT>
__device__ void gemv_bf16_rows(const bf16* x, int n, int in, int accumulate, int split, const GemvMats& m) {
    uint4 q[GEMV_LOADS];
    gemv_rows<NT>(x, n, in, accumulate, split, m, q, false);
}

#define GEMV_ARGS const bf16 *w0, float *y0, int out0, const float *b0, const bf16 *w1, float *y1, int out1, \
    const float *b1, const bf16 *w2, float *y2, int out2, const float *b2
#define GEMV_MATS_OF {{w0, w1, w2}, {y0, y1, y2}, {out0, out1, out2}, {b0, b1, b2}}

extern "C" __global__ void gemv_bf16(const bf16* x, int n, int in, int accumulate, int split, GEMV_ARGS) {
    gemv_bf16_rows<GEMV_MAX_TOKENS>(x, n, in, accumulate, split, GemvMats GEMV_MATS_OF);
}
extern "C" __global__ __launch_bounds__(256, GEMV_FEW_ROWS_BLOCKS) void gemv_bf16_1(const bf16* x, int n, int in,
        int accumulate, int split, GEMV_ARGS) {
    gemv_bf16_rows<1>(x, n, in, accumulate, split, GemvMats GEMV_MATS_OF);
}
extern "C" __global__ __launch_bounds__(256, GEMV_FEW_ROWS_BLOCKS) void gemv_bf16_2(const bf16* x, int n, int in,
        int accumulate, int split, GEMV_ARGS) {
    gemv_bf16_rows<2>(x, n, in, accumulate, split, GemvMats GEMV_MATS_OF);
}

// RMSNorm of n rows of x (f32 [n, dim]) with weights w, rounded to bf16 into `out` (shared memory),
// and into `copy` (global, may be null) too, by kernels.cu's rms_norm_row: with a block of 256 threads,
// rms_norm's bf16 values. Called by every thread.
__device__ void rms_norm_rows_bf16(const float* x, const float* w, float eps, int n, int dim, bf16* out, bf16* copy,
                                   float* buf) {
    for (int t = 0; t < n; ++t) {
        bf16* o = out + (size_t)t * dim;
        bf16* c = copy ? copy + (size_t)t * dim : nullptr;
        rms_norm_row(x + (size_t)t * dim, w, dim, eps, buf, [&](int i, float v) {
            bf16 b = f2bf(v);
            o[i] = b;
            if (c) c[i] = b;
        });
    }
    __syncthreads();
}

// gemv_bf16 over the RMS-normalised residual rows: the input is norm(x) (x f32 [n, in], norm weights
// norm_w, eps), which every block computes into shared memory while its first chunk of weight loads
// is in flight (a row of 2048-4096 values: cheap next to the weights), in rms_norm's order, then the
// GEMV of gemv_bf16 with the same `split` (so the products and sums are those of rms_norm followed by
// gemv_bf16, bit for bit). Block 0 also writes the normalised rows to xb (bf16 [n, in]) for the ops
// that read them later. Never accumulates. Blocks stride over the rows as gemv_bf16's: a resident grid
// normalises once per block. Block: 256 threads (rms_norm's order); dynamic shared memory: n * in
// bf16. Entries per bound on the rows as gemv_bf16's.
template <int NT>
__device__ void gemv_bf16_norm_rows(const float* x, const float* norm_w, float eps, int n, int in, int split,
                                    bf16* xb, const GemvMats& m) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    bf16* xs = (bf16*)gemv_smem;
    __shared__ float buf[32];
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, per_block = blockDim.x / WARP / split;
    uint4 q[GEMV_LOADS];
    // (only the weight row is live across the norm: the loads' registers must not spill)
    const bf16* w = gemv_row(blockIdx.x * per_block + warp / split, m, in).w;
    if (w) gemv_load(w, in, lane * 8 + (warp % split) * GEMV_CHUNK, q);
    rms_norm_rows_bf16(x, norm_w, eps, n, in, xs, blockIdx.x == 0 ? xb : nullptr, buf);
    gemv_rows<NT>(xs, n, in, 0, split, m, q, w != nullptr);
}

#define GEMV_NORM_ARGS const float *x, const float *norm_w, float eps, int n, int in, int split, bf16 *xb, GEMV_ARGS

extern "C" __global__ void gemv_bf16_norm(GEMV_NORM_ARGS) {
    gemv_bf16_norm_rows<GEMV_MAX_TOKENS>(x, norm_w, eps, n, in, split, xb, GemvMats GEMV_MATS_OF);
}
extern "C" __global__ __launch_bounds__(256, GEMV_NORM_FEW_ROWS_BLOCKS) void gemv_bf16_norm_1(GEMV_NORM_ARGS) {
    gemv_bf16_norm_rows<1>(x, norm_w, eps, n, in, split, xb, GemvMats GEMV_MATS_OF);
}
extern "C" __global__ __launch_bounds__(256, GEMV_NORM_FEW_ROWS_BLOCKS) void gemv_bf16_norm_2(GEMV_NORM_ARGS) {
    gemv_bf16_norm_rows<2>(x, norm_w, eps, n, in, split, xb, GemvMats GEMV_MATS_OF);
}

// Per-head RMSNorm + RoPE of q and k rows, and the k and v rows appended to bf16 paged caches, in one
// launch: block (t, h) for h < heads is query head h of row t (in place in q, as qk_norm_rope); for
// h >= heads it is KV head h - heads: k's head normalised and rotated in place, then k's and v's head
// rounded to bf16 into cache row slot_of_token[t] (as kv_append). norm weights may be null (no norm);
// rotary_dim 0: no rotation. Caches are [slots, kv_heads * head_dim].
// grid: (tokens, heads + kv_heads); block: head_dim rounded up to a warp multiple (<= 1024).
extern "C" __global__ void qk_norm_rope_append(float* q, float* k, const float* v, int heads, int kv_heads,
                                               int head_dim, const float* q_norm, const float* k_norm, float eps,
                                               const int* positions, const float* inv_freq, float attn_factor,
                                               int rotary_dim, int style, bf16* k_cache, bf16* v_cache,
                                               const int* slot_of_token) {
    __shared__ float buf[32];
    __shared__ float head[1024];
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (h < heads) {
        norm_rope_head(q + ((size_t)t * heads + h) * head_dim, head_dim, q_norm, eps, positions, t, inv_freq,
                       attn_factor, rotary_dim, style, 0, head, buf);
        return;
    }
    int kvh = h - heads, width = kv_heads * head_dim;
    float* kh = k + (size_t)t * width + (size_t)kvh * head_dim;
    norm_rope_head(kh, head_dim, k_norm, eps, positions, t, inv_freq, attn_factor, rotary_dim, style, 0, head,
                   buf);
    if (d < head_dim) {
        size_t at = (size_t)slot_of_token[t] * width + (size_t)kvh * head_dim + d;
        // each thread rounds the value it wrote itself: no barrier needed
        k_cache[at] = f2bf(kh[d]);
        v_cache[at] = f2bf(v[(size_t)t * width + (size_t)kvh * head_dim + d]);
    }
}

// Decode attention with the positions spread over the block's warps (paged_attention_rows walks them one
// tile at a time and each thread dots a whole key, so a short context costs a dependent memory round
// trip per position). Same contract and grid as paged_attention_rows: block (t, h) is query head h of
// row row0 + t, keys lo..=pos of its sequence. Warp w takes runs of PA_RUN consecutive positions
// (run w, w + warps, ...); each lane holds dims lane + 32 c of q, of the keys' and values' rows and
// of its output, so a key's dot product is a warp sum and its loads are coalesced; each warp keeps its
// own online softmax, and the warps' states are merged through shared memory at the end.
// grid: (rows, heads); block: PA_WARPS warps; head_dim <= 32 * PA_DIMS.
#define PA_WARPS 8
#define PA_DIMS 8
#define PA_RUN 4
template <typename KV>
__device__ void paged_attention_warps_rows(const float* q, KV kc, KV vc, const int* block_tables, int max_blocks,
                                           const int* seq_of_token, const int* pos_of_token, int heads,
                                           int kv_heads, int head_dim, int block_size, float scale, int window,
                                           int row0, bf16* out) {
    __shared__ float wm[PA_WARPS], wl[PA_WARPS];
    __shared__ float wacc[PA_WARPS][WARP * PA_DIMS];
    int t = blockIdx.x + row0, h = blockIdx.y;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int kvh = h / (heads / kv_heads);
    const int* table = block_tables + (size_t)seq_of_token[t] * max_blocks;
    int pos = pos_of_token[t];
    int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const float* qh = q + ((size_t)t * heads + h) * head_dim;
    float qv[PA_DIMS], acc[PA_DIMS];
#pragma unroll
    for (int c = 0; c < PA_DIMS; ++c) {
        int i = lane + WARP * c;
        qv[c] = i < head_dim ? qh[i] : 0.f;
        acc[c] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int base = lo + warp * PA_RUN; base <= pos; base += PA_WARPS * PA_RUN) {
        // the run's keys and values, all loads issued before any is used
        float kv[PA_RUN][PA_DIMS], vv[PA_RUN][PA_DIMS];
#pragma unroll
        for (int u = 0; u < PA_RUN; ++u) {
            int p = min(base + u, pos);  // past the end: a repeat of pos, masked below
            size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
#pragma unroll
            for (int c = 0; c < PA_DIMS; ++c) {
                int i = lane + WARP * c;
                kv[u][c] = i < head_dim ? kc.at(slot, kvh, i) : 0.f;
                vv[u][c] = i < head_dim ? vc.at(slot, kvh, i) : 0.f;
            }
        }
        float s[PA_RUN];
        float run_max = -INFINITY;
#pragma unroll
        for (int u = 0; u < PA_RUN; ++u) {
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < PA_DIMS; ++c) dot += qv[c] * kv[u][c];
            s[u] = base + u <= pos ? warp_sum(dot) * scale : -INFINITY;
            run_max = fmaxf(run_max, s[u]);
        }
        float m_new = fmaxf(m, run_max);
        float corr = __expf(m - m_new);
        l *= corr;
#pragma unroll
        for (int c = 0; c < PA_DIMS; ++c) acc[c] *= corr;
#pragma unroll
        for (int u = 0; u < PA_RUN; ++u) {
            float e = base + u <= pos ? __expf(s[u] - m_new) : 0.f;
            l += e;
#pragma unroll
            for (int c = 0; c < PA_DIMS; ++c) acc[c] += e * vv[u][c];
        }
        m = m_new;
    }
    // merge the warps: out = sum_w acc_w e^(m_w - M) / sum_w l_w e^(m_w - M); a warp that saw no
    // position has m_w = -inf and weighs 0 (warp 0 always sees position lo)
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < PA_DIMS; ++c) wacc[warp][lane + WARP * c] = acc[c];
    __syncthreads();
    float big = -INFINITY;
    for (int w = 0; w < PA_WARPS; ++w) big = fmaxf(big, wm[w]);
    float total = 0.f;
    for (int w = 0; w < PA_WARPS; ++w) total += wl[w] * __expf(wm[w] - big);
    bf16* o = out + ((size_t)t * heads + h) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < PA_WARPS; ++w) a += wacc[w][i] * __expf(wm[w] - big);
        o[i] = f2bf(a / total);
    }
}

extern "C" __global__ void paged_attention_warps(const float* q, const bf16* k_cache, const bf16* v_cache,
                                                 const int* block_tables, int max_blocks, const int* seq_of_token,
                                                 const int* pos_of_token, int heads, int kv_heads, int head_dim,
                                                 int block_size, float scale, int window, int row0, bf16* out) {
    int width = kv_heads * head_dim;
    paged_attention_warps_rows(q, KvBf16{k_cache, width, head_dim}, KvBf16{v_cache, width, head_dim},
                               block_tables, max_blocks, seq_of_token, pos_of_token, heads, kv_heads, head_dim,
                               block_size, scale, window, row0, out);
}

extern "C" __global__ void paged_attention_warps_q8(const float* q, const unsigned char* k_codes,
                                                    const unsigned char* v_codes, const float* k_scales,
                                                    const float* v_scales, int group, int code,
                                                    const int* block_tables, int max_blocks,
                                                    const int* seq_of_token, const int* pos_of_token, int heads,
                                                    int kv_heads, int head_dim, int block_size, float scale,
                                                    int window, int row0, bf16* out) {
    int width = kv_heads * head_dim;
    paged_attention_warps_rows(q, KvQ8{k_codes, k_scales, width, head_dim, group, code},
                               KvQ8{v_codes, v_scales, width, head_dim, group, code}, block_tables, max_blocks,
                               seq_of_token, pos_of_token, heads, kv_heads, head_dim, block_size, scale, window,
                               row0, out);
}

// router_topk_row's selection and weights for routers without expert groups (softmax, or sigmoid
// with n_group <= 1), at most 32 * TOPK_WARP_PER_LANE experts and k <= 32, by one warp: lane i holds experts
// i, i + 32, ..., and each of the k rounds is a warp argmax (ties to the lower index, as
// block_argmax), with no block barrier. The logits are read through L2 (other blocks wrote them).
#define TOPK_WARP_PER_LANE 8
__device__ void router_topk_warp(const float* l, int experts, int k, int kind, int renorm, const float* bias,
                                 float scaling, int* ids, float* weights) {
    int lane = threadIdx.x % WARP;
    float sel[TOPK_WARP_PER_LANE], val[TOPK_WARP_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < TOPK_WARP_PER_LANE; ++j) {
        int e = lane + j * WARP;
        sel[j] = e < experts ? __ldcg(l + e) : -INFINITY;
        mx = fmaxf(mx, sel[j]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    if (kind == 0) {
#pragma unroll
        for (int j = 0; j < TOPK_WARP_PER_LANE; ++j)
            if (lane + j * WARP < experts) sum += __expf(sel[j] - mx);
        sum = warp_sum(sum);
    }
#pragma unroll
    for (int j = 0; j < TOPK_WARP_PER_LANE; ++j) {
        int e = lane + j * WARP;
        if (e >= experts) {
            val[j] = 0.f;
        } else if (kind == 0) {
            val[j] = __expf(sel[j] - mx) / sum;
        } else {
            float sg = 1.f / (1.f + __expf(-sel[j]));
            val[j] = sg;
            sel[j] = sg + (bias ? bias[e] : 0.f);
        }
    }
    float wsum = 0.f, mine = 0.f;
    for (int r = 0; r < k; ++r) {
        float v = -INFINITY;
        int bi = -1;
#pragma unroll
        for (int j = 0; j < TOPK_WARP_PER_LANE; ++j)
            if (sel[j] > v || (bi < 0 && sel[j] == v && lane + j * WARP < experts)) {
                v = sel[j];
                bi = lane + j * WARP;
            }
        for (int o = WARP / 2; o > 0; o >>= 1) {
            float v2 = __shfl_xor_sync(0xffffffff, v, o);
            int i2 = __shfl_xor_sync(0xffffffff, bi, o);
            if (v2 > v || (v2 == v && i2 >= 0 && (bi < 0 || i2 < bi))) { v = v2; bi = i2; }
        }
        // the owner of the winner takes it out and hands its weight to every lane
        float w = 0.f;
#pragma unroll
        for (int j = 0; j < TOPK_WARP_PER_LANE; ++j)
            if (lane + j * WARP == bi) { w = val[j]; sel[j] = -INFINITY; }
        w = __shfl_sync(0xffffffff, w, bi % WARP);
        wsum += w;
        if (lane == r) { mine = w; ids[r] = bi; }
    }
    // lane r < k renormalises and scales its choice (k <= 32 on this path)
    if (lane < k) {
        float w = mine;
        if (renorm) w = kind == 0 ? w / wsum : w / (wsum + 1e-20f);
        weights[lane] = kind == 1 ? w * scaling : w;
    }
}

// RMSNorm of n rows of x (f32 [n, dim]) with weights w into `out` (f32, shared memory), by
// rms_norm_row: with a block of 256 threads, rms_norm's f32 values. Called by every thread.
__device__ void rms_norm_rows_f32(const float* x, const float* w, float eps, int n, int dim, float* out, float* buf) {
    for (int t = 0; t < n; ++t) {
        float* o = out + (size_t)t * dim;
        rms_norm_row(x + (size_t)t * dim, w, dim, eps, buf, [&](int i, float v) { o[i] = v; });
    }
    __syncthreads();
}

// Warps per expert in router_gemv_topk (each over a contiguous share of the inputs, so a 2048-input
// row is one round of GEMV_LOADS loads per lane), and the most warps per block.
#define ROUTER_SPLIT 2
#define ROUTER_MAX_WARPS 8

// Floats of router_gemv_topk's dynamic shared memory before the normalised rows: the top-k's three
// arrays of `experts`, rounded up to 16 bytes.
__device__ __forceinline__ int router_topk_floats(int experts) { return (3 * experts + 3) & ~3; }

// The router of up to GEMV_MAX_TOKENS rows and its top-k in one launch: logits[t, e] = x[t] . W[e]
// (f32 x [n, in], f32 W [experts, in]; ROUTER_SPLIT warps per expert, 16-byte loads, in % 4 == 0),
// then the last block to finish (blocks_done: device memory, 0 between launches) runs
// router_topk_row over each row's logits, read back through L2. With norm_w the router's input is
// RMSNorm(x) (the FFN norm folded in): every block normalises the rows into shared memory while its
// first weight loads are in flight (rms_norm's order and values) and writes its share of them to xb
// (bf16) and xf (f32), where the later ops read them. When ids_h is given it then does
// handoff_publish's work (handoff.cu): the routing, and when x_h is given the router's input rows,
// into the mapped host buffers, the time stamped and `flag` raised.
// grid: ceil(experts / (blockDim.x / 32 / ROUTER_SPLIT)); block: ROUTER_MAX_WARPS warps (>= k threads;
// 256 threads for rms_norm's order). Dynamic shared memory: router_topk_floats(experts) floats, plus
// n * in with norm_w.
extern "C" __global__ void router_gemv_topk(const float* x, int n, int in, const float* norm_w, float eps, bf16* xb,
                                            float* xf, const float* w, int experts, int k, int kind, int renorm,
                                            const float* bias, int n_group, int topk_group, float scaling,
                                            float* logits, int* ids, float* weights, unsigned int* blocks_done,
                                            int* ids_h, float* w_h, float* x_h, volatile int* flag,
                                            volatile unsigned long long* stamps) {
    extern __shared__ __align__(16) float sm[];
    __shared__ bool last;
    __shared__ float buf[32];
    __shared__ float part[ROUTER_MAX_WARPS][GEMV_MAX_TOKENS];
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int e = blockIdx.x * (blockDim.x / WARP / ROUTER_SPLIT) + warp / ROUTER_SPLIT;
    int in4 = in / 4, share = (in4 + ROUTER_SPLIT - 1) / ROUTER_SPLIT;
    int c_lo = (warp % ROUTER_SPLIT) * share, c_hi = min(in4, c_lo + share);
    bool active = e < experts;
    const float4* wr = (const float4*)(w + (size_t)e * in);
    float4 wv[GEMV_LOADS];
    // the first round of weight loads, in flight while the rows are normalised
    if (active) {
#pragma unroll
        for (int j = 0; j < GEMV_LOADS; ++j)
            if (c_lo + lane + j * WARP < c_hi) wv[j] = wr[c_lo + lane + j * WARP];
    }
    const float* xin = x;
    if (norm_w) {
        float* rows = sm + router_topk_floats(experts);
        rms_norm_rows_f32(x, norm_w, eps, n, in, rows, buf);
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * in; i += gridDim.x * blockDim.x) {
            xf[i] = rows[i];
            xb[i] = f2bf(rows[i]);
        }
        xin = rows;
    }
    float acc[GEMV_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] = 0.f;
    if (active) {
        for (int c0 = c_lo + lane; c0 < c_hi; c0 += GEMV_LOADS * WARP) {
            if (c0 != c_lo + lane) {
#pragma unroll
                for (int j = 0; j < GEMV_LOADS; ++j)
                    if (c0 + j * WARP < c_hi) wv[j] = wr[c0 + j * WARP];
            }
#pragma unroll
            for (int j = 0; j < GEMV_LOADS; ++j) {
                int c = c0 + j * WARP;
                if (c >= c_hi) break;
#pragma unroll
                for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
                    if (t < n) {
                        float4 xv = ((const float4*)(xin + (size_t)t * in))[c];
                        acc[t] += wv[j].x * xv.x + wv[j].y * xv.y + wv[j].z * xv.z + wv[j].w * xv.w;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
        if (t < n) {
            float v = warp_sum(acc[t]);
            if (lane == 0) part[warp][t] = v;
        }
    }
    __syncthreads();
    // the expert's first warp adds its warps' shares: lane t for row t
    if (active && warp % ROUTER_SPLIT == 0 && lane < n) {
        float v = 0.f;
        for (int h = 0; h < ROUTER_SPLIT; ++h) v += part[warp + h][lane];
        logits[(size_t)lane * experts + e] = v;
    }
    // this block's logits are visible device-wide before it is counted
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(blocks_done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (n_group <= 1 && experts <= WARP * TOPK_WARP_PER_LANE && k <= WARP) {
        // a warp per row (no block barrier in its k rounds)
        int warps = blockDim.x / WARP;
        for (int t = threadIdx.x / WARP; t < n; t += warps)
            router_topk_warp(logits + (size_t)t * experts, experts, k, kind, renorm, bias, scaling,
                             ids + (size_t)t * k, weights + (size_t)t * k);
        __syncthreads();
    } else {
        float* row = sm + 2 * experts;
        for (int t = 0; t < n; ++t) {
            for (int i = threadIdx.x; i < experts; i += blockDim.x)
                row[i] = __ldcg(logits + (size_t)t * experts + i);
            __syncthreads();
            router_topk_row(row, experts, k, kind, renorm, bias, n_group, topk_group, scaling,
                            ids + (size_t)t * k, weights + (size_t)t * k, sm);
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) *blocks_done = 0;
    if (!ids_h) return;
    // (each row's ids and weights were written by this block before the loop's last barrier)
    for (int i = threadIdx.x; i < n * k; i += blockDim.x) {
        ids_h[i] = ids[i];
        w_h[i] = weights[i];
    }
    if (x_h) {
        const float4* x4 = (const float4*)xin;
        float4* h4 = (float4*)x_h;
        for (int i = threadIdx.x; i < n * in / 4; i += blockDim.x) h4[i] = x4[i];
    }
    // the stamp goes with the data: one system fence orders both before the flag
    if (threadIdx.x == 0) stamps[STAMP_PUBLISHED] = global_ns();
    // every thread's host writes are visible system-wide before the flag
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) *flag = 1;
}

// Bytes [0, bytes) of `p` fetched into L2 and marked evict-last, without reading them into registers:
// a layer's segment weights brought in while the GPU has nothing else to read (it waits for the
// host's CPU experts), so the segment's GEMVs find them in L2 instead of DRAM. A thread per 128-byte
// line, striding over the range. grid: any; block: any.
extern "C" __global__ void l2_prefetch(const char* p, unsigned long long bytes) {
    size_t stride = (size_t)gridDim.x * blockDim.x * 128;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 128; i < bytes; i += stride)
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + i));
}
