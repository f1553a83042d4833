// ---- The decode segment's fused kernels (a layer's work between two CPU expert calls at batch 1..8) ----
// Appended to the start-up module (uses common.cuh's reductions, kernels.cu's norm_rope_head,
// router_topk_row and KvBf16, dense_quant.cu's dot8 / gemv_store, kv_q8.cu's KvQ8). At decode sizes
// every op of the segment is bound by its launch and its memory latency, not by bandwidth (the ~40 MB
// a Qwen3-30B-A3B layer reads take ~10 µs at HBM speed), so these kernels cut launches and dependent
// memory round trips: q/k/v as one GEMV launch, q/k norm + RoPE + the cache append as one, decode
// attention spread over warps, and the router's GEMV with its top-k.

// y_m[t, r] (=|+=) x[t] . W_m[r] for up to three bf16 matrices W_m ([out_m, in]) sharing the input
// x (bf16 [n, in], n <= GEMV_MAX_TOKENS): output rows of all matrices are numbered in one range, one
// warp per row; each lane takes 8 consecutive inputs (one 16-byte load) per step, so a warp reads 512
// contiguous bytes and each lane keeps up to four loads in flight. in % 8 == 0, 16-byte aligned rows.
// grid: ceil((out0 + out1 + out2) / (blockDim.x / 32)); block: a multiple of 32.
#define GEMV_LOADS 8
extern "C" __global__ void gemv_bf16(const bf16* x, int n, int in, int accumulate, const bf16* w0, float* y0,
                                     int out0, const bf16* w1, float* y1, int out1, const bf16* w2, float* y2,
                                     int out2) {
    int r = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const bf16* w;
    float* y;
    int out;
    if (r < out0) {
        w = w0; y = y0; out = out0;
    } else if ((r -= out0) < out1) {
        w = w1; y = y1; out = out1;
    } else if ((r -= out1) < out2) {
        w = w2; y = y2; out = out2;
    } else {
        return;
    }
    int lane = threadIdx.x % WARP;
    float acc[GEMV_MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] = 0.f;
    const uint4* wr = (const uint4*)(w + (size_t)r * in);
    // the row in chunks of GEMV_LOADS 16-byte loads per lane, all issued before any is used (a
    // row of 4096 inputs is two chunks): the kernel is bound by how many loads are in flight
    for (int c0 = lane * 8; c0 < in; c0 += GEMV_LOADS * WARP * 8) {
        uint4 q[GEMV_LOADS];
#pragma unroll
        for (int j = 0; j < GEMV_LOADS; ++j) {
            int c = c0 + j * WARP * 8;
            if (c < in) q[j] = wr[c / 8];
        }
#pragma unroll
        for (int j = 0; j < GEMV_LOADS; ++j) {
            int c = c0 + j * WARP * 8;
            if (c >= in) break;
            unsigned int words[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
            float wv[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                wv[2 * i] = __uint_as_float(words[i] << 16);
                wv[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
            }
            dot8(x, in, n, c, wv, acc);
        }
    }
    gemv_store(acc, n, out, r, accumulate, y);
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

// The router of up to GEMV_MAX_TOKENS rows and its top-k in one launch: logits[t, e] = x[t] . W[e]
// (f32 x [n, in], f32 W [experts, in]; one warp per expert, 16-byte loads, in % 4 == 0), then the
// last block to finish (blocks_done: device memory, 0 between launches) runs router_topk_row over
// each row's logits, read back through L2. When ids_h is given it then does handoff_publish's work
// (handoff.cu): the routing, and when x_h is given the router's input rows x, into the mapped host
// buffers, the time stamped and `flag` raised. grid: ceil(experts / (blockDim.x / 32)); block:
// ROUTER_THREADS (>= k). Dynamic shared memory: 3 * experts floats.
extern "C" __global__ void router_gemv_topk(const float* x, int n, int in, const float* w, int experts, int k,
                                            int kind, int renorm, const float* bias, int n_group, int topk_group,
                                            float scaling, float* logits, int* ids, float* weights,
                                            unsigned int* blocks_done, int* ids_h, float* w_h, float* x_h,
                                            volatile int* flag, volatile unsigned long long* stamps) {
    extern __shared__ float sm[];
    __shared__ bool last;
    int e = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP, lane = threadIdx.x % WARP;
    if (e < experts) {
        float acc[GEMV_MAX_TOKENS];
#pragma unroll
        for (int t = 0; t < GEMV_MAX_TOKENS; ++t) acc[t] = 0.f;
        const float4* wr = (const float4*)(w + (size_t)e * in);
        for (int c0 = lane; c0 < in / 4; c0 += GEMV_LOADS * WARP) {
            float4 wv[GEMV_LOADS];
#pragma unroll
            for (int j = 0; j < GEMV_LOADS; ++j)
                if (c0 + j * WARP < in / 4) wv[j] = wr[c0 + j * WARP];
#pragma unroll
            for (int j = 0; j < GEMV_LOADS; ++j) {
                int c = c0 + j * WARP;
                if (c >= in / 4) break;
#pragma unroll
                for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
                    if (t < n) {
                        float4 xv = ((const float4*)(x + (size_t)t * in))[c];
                        acc[t] += wv[j].x * xv.x + wv[j].y * xv.y + wv[j].z * xv.z + wv[j].w * xv.w;
                    }
                }
            }
        }
#pragma unroll
        for (int t = 0; t < GEMV_MAX_TOKENS; ++t) {
            if (t < n) {
                float v = warp_sum(acc[t]);
                if (lane == 0) logits[(size_t)t * experts + e] = v;
            }
        }
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
        const float4* x4 = (const float4*)x;
        float4* h4 = (float4*)x_h;
        for (int i = threadIdx.x; i < n * in / 4; i += blockDim.x) h4[i] = x4[i];
    }
    // every thread's host writes are visible system-wide before the flag
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        stamps[STAMP_PUBLISHED] = global_ns();
        __threadfence_system();
        *flag = 1;
    }
}
