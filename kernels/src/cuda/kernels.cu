// CUDA kernels of the GPU backend, compiled at start-up by NVRTC for the device's architecture.
// Activations are f32 in the residual stream and bf16 at GEMM inputs (cuBLAS bf16 x bf16 -> f32).
// bf16 is handled as raw bits so NVRTC needs no CUDA headers (the GPU machine may lack an include path).
// One row's RMSNorm, x[i] * inv * w[i] for i < dim with inv = 1 / rms(x[..dim]) (eps), handed to
// emit(i, value) for each of the thread's elements; the squares are summed per thread over its
// elements threadIdx.x + k * blockDim.x in k order, then by block_sum (so every kernel that normalises
// with a block of the same size gets the same values as rms_norm). Up to NORM_REGS elements per thread, their loads are all
// issued at once and kept in registers (a loop would wait for each load before the next: a dependent
// L2 round trip per element); longer rows (GLM-4.5's 4096 at 256 threads) are read in spans of
// NORM_REGS loads in flight, twice (the sum, then the values). Called by every thread.
#define NORM_REGS 8
template <typename Emit>
__device__ __forceinline__ void rms_norm_row(const float* xr, const float* w, int dim, float eps, float* buf,
                                             Emit emit) {
    float ss = 0.f;
    if (dim <= NORM_REGS * (int)blockDim.x) {
        float xv[NORM_REGS];
#pragma unroll
        for (int k = 0; k < NORM_REGS; ++k) {
            int i = threadIdx.x + k * blockDim.x;
            xv[k] = i < dim ? xr[i] : 0.f;
        }
#pragma unroll
        for (int k = 0; k < NORM_REGS; ++k)
            if (threadIdx.x + k * blockDim.x < dim) ss += xv[k] * xv[k];
        float inv = rsqrtf(block_sum(ss, buf) / dim + eps);
#pragma unroll
        for (int k = 0; k < NORM_REGS; ++k) {
            int i = threadIdx.x + k * blockDim.x;
            if (i < dim) emit(i, xv[k] * inv * w[i]);
        }
    } else {
        // NORM_REGS loads in flight at a time, summed in the same order as one at a time
        int span = NORM_REGS * (int)blockDim.x;
        for (int i0 = 0; i0 < dim; i0 += span) {
            float xv[NORM_REGS];
#pragma unroll
            for (int k = 0; k < NORM_REGS; ++k) {
                int i = i0 + threadIdx.x + k * blockDim.x;
                xv[k] = i < dim ? xr[i] : 0.f;
            }
#pragma unroll
            for (int k = 0; k < NORM_REGS; ++k)
                if (i0 + threadIdx.x + k * blockDim.x < dim) ss += xv[k] * xv[k];
        }
        float inv = rsqrtf(block_sum(ss, buf) / dim + eps);
        for (int i0 = 0; i0 < dim; i0 += span) {
            float xv[NORM_REGS];
#pragma unroll
            for (int k = 0; k < NORM_REGS; ++k) {
                int i = i0 + threadIdx.x + k * blockDim.x;
                xv[k] = i < dim ? xr[i] : 0.f;
            }
#pragma unroll
            for (int k = 0; k < NORM_REGS; ++k) {
                int i = i0 + threadIdx.x + k * blockDim.x;
                if (i < dim) emit(i, xv[k] * inv * w[i]);
            }
        }
    }
}

// out_bf16[row] = x[row] * w / rms(x[row]); one block per row. Optional f32 copy (out_f32 may be null).
extern "C" __global__ void rms_norm(const float* x, const float* w, float eps, int dim,
                                    bf16* out_bf16, float* out_f32) {
    __shared__ float buf[32];
    size_t row = (size_t)blockIdx.x * dim;
    rms_norm_row(x + row, w, dim, eps, buf, [&](int i, float v) {
        if (out_bf16) out_bf16[row + i] = f2bf(v);
        if (out_f32) out_f32[row + i] = v;
    });
}

// One head `xh` of row `t`, in place: RMSNorm (when norm_w) then RoPE on dims offset_in_head..+rotary_dim
// (none when rotary_dim == 0; positions is read only then). Called by every thread of a block of
// head_dim threads rounded up to a warp multiple (<= 1024); `head` holds 1024 floats and `buf` 32 of
// shared memory. style 0 = neox (rotate_half), 1 = interleaved.
__device__ void norm_rope_head(float* xh, int head_dim, const float* norm_w, float eps, const int* positions, int t,
                               const float* inv_freq, float attn_factor, int rotary_dim, int style,
                               int offset_in_head, float* head, float* buf) {
    int d = threadIdx.x;
    float v = (d < head_dim) ? xh[d] : 0.f;
    if (norm_w) {
        float ss = block_sum(v * v, buf);
        v = v * rsqrtf(ss / head_dim + eps) * (d < head_dim ? norm_w[d] : 0.f);
    }
    if (d < head_dim) head[d] = v;
    __syncthreads();
    int r = d - offset_in_head;  // rotary dims start at offset_in_head (MLA: after the nope part)
    int half = rotary_dim / 2;
    if (r >= 0 && r < rotary_dim) {
        int i = r < half ? r : r - half;
        float ang = (float)positions[t] * inv_freq[i];
        float c = cosf(ang) * attn_factor, s = sinf(ang) * attn_factor;
        float a, b;
        if (style == 0) { a = head[offset_in_head + i]; b = head[offset_in_head + i + half]; }
        else { a = head[offset_in_head + 2 * i]; b = head[offset_in_head + 2 * i + 1]; }
        v = r < half ? a * c - b * s : b * c + a * s;
    }
    if (d < head_dim) xh[d] = v;
}

// In-place per-head RMSNorm (optional) then RoPE on the first rotary_dim dims of each head.
// grid: (tokens, heads); block: head_dim threads (<= 1024). style 0 = neox (rotate_half), 1 = interleaved.
extern "C" __global__ void qk_norm_rope(float* x, int heads, int head_dim, const float* norm_w, float eps,
                                        const int* positions, const float* inv_freq, float attn_factor,
                                        int rotary_dim, int style, int offset_in_head) {
    __shared__ float buf[32];
    __shared__ float head[1024];
    int t = blockIdx.x, h = blockIdx.y;
    norm_rope_head(x + ((size_t)t * heads + h) * head_dim, head_dim, norm_w, eps, positions, t, inv_freq,
                   attn_factor, rotary_dim, style, offset_in_head, head, buf);
}

// Writes k and v rows of each token into the paged caches, rounded to bf16: cache[slot][width] (MLA:
// latent and rope key). The caches are bf16 (as vLLM's default for bf16 models): half the bytes of f32,
// which is what lets a long context fit on a 24 GB card; attention reads them back into f32.
extern "C" __global__ void kv_append(const float* k, const float* v, int k_width, int v_width, bf16* k_cache,
                                     bf16* v_cache, const int* slot_of_token, int block_size) {
    int t = blockIdx.x;
    size_t slot = (size_t)slot_of_token[t];
    for (int i = threadIdx.x; i < k_width; i += blockDim.x) k_cache[slot * k_width + i] = f2bf(k[(size_t)t * k_width + i]);
    for (int i = threadIdx.x; i < v_width; i += blockDim.x) v_cache[slot * v_width + i] = f2bf(v[(size_t)t * v_width + i]);
}

// MLA: splits kv_a_proj_with_mqa's output [tokens, lora + rope] into the RMS-normalised latent [tokens, lora]
// and the (not yet roped) shared key [tokens, rope]. One block per token.
extern "C" __global__ void mla_split_latent(const float* ckv, const float* w, float eps, int lora, int rope,
                                            float* latent, float* krope) {
    __shared__ float buf[32];
    const float* r = ckv + (size_t)blockIdx.x * (lora + rope);
    float ss = 0.f;
    for (int i = threadIdx.x; i < lora; i += blockDim.x) ss += r[i] * r[i];
    ss = block_sum(ss, buf);
    float inv = rsqrtf(ss / lora + eps);
    for (int i = threadIdx.x; i < lora; i += blockDim.x) latent[(size_t)blockIdx.x * lora + i] = r[i] * inv * w[i];
    for (int i = threadIdx.x; i < rope; i += blockDim.x) krope[(size_t)blockIdx.x * rope + i] = r[lora + i];
}

// MLA attention in absorbed form for one (token, head): q_lat = W_ukᵀ q_nope; scores against the cached
// latent and rope key of positions 0..=pos (online softmax); o_lat = Σ p·latent; out = W_uv o_lat.
// kv_b: [heads × (nope + v), lora] f32. grid (tokens, heads), block 128.
extern "C" __global__ void mla_attention(const float* q, const bf16* lat_cache, const bf16* rope_cache,
                                         const int* block_tables, int max_blocks, const int* seq_of_token,
                                         const int* pos_of_token, int heads, int nope, int rope, int lora,
                                         int vdim, const float* kv_b, int block_size, float scale,
                                         bf16* out) {
    extern __shared__ float smem[];  // qn[nope] qr[rope] q_lat[lora] o_lat[lora] sc[blockDim]
    __shared__ float buf[32];
    float* qn = smem;
    float* qr = qn + nope;
    float* q_lat = qr + rope;
    float* o_lat = q_lat + lora;
    float* sc = o_lat + lora;
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const float* qh = q + ((size_t)t * heads + h) * (nope + rope);
    for (int i = tid; i < nope + rope; i += blockDim.x) { if (i < nope) qn[i] = qh[i]; else qr[i - nope] = qh[i]; }
    __syncthreads();
    const float* wk = kv_b + (size_t)h * (nope + vdim) * lora;
    for (int c = tid; c < lora; c += blockDim.x) {
        float a = 0.f;
        for (int d = 0; d < nope; ++d) a += qn[d] * wk[(size_t)d * lora + c];
        q_lat[c] = a;
        o_lat[c] = 0.f;
    }
    __syncthreads();
    const int* table = block_tables + (size_t)seq_of_token[t] * max_blocks;
    int pos = pos_of_token[t];
    float m = -INFINITY, l = 0.f;
    for (int base = 0; base <= pos; base += blockDim.x) {
        int p = base + tid;
        float s = -INFINITY;
        if (p <= pos) {
            size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
            const bf16* lr = lat_cache + slot * lora;
            const bf16* rr = rope_cache + slot * rope;
            float dot = 0.f;
            for (int c = 0; c < lora; ++c) dot += q_lat[c] * bf2f(lr[c]);
            for (int r = 0; r < rope; ++r) dot += qr[r] * bf2f(rr[r]);
            s = dot * scale;
        }
        float m_new = fmaxf(m, block_max(s, buf));
        float corr = __expf(m - m_new);
        float e = (p <= pos) ? __expf(s - m_new) : 0.f;
        sc[tid] = e;
        l = l * corr + block_sum(e, buf);
        int n = min((int)blockDim.x, pos - base + 1);
        for (int c = tid; c < lora; c += blockDim.x) {
            float a = o_lat[c] * corr;
            for (int j = 0; j < n; ++j) {
                int pj = base + j;
                size_t slot = (size_t)table[pj / block_size] * block_size + pj % block_size;
                a += sc[j] * bf2f(lat_cache[slot * lora + c]);
            }
            o_lat[c] = a;
        }
        m = m_new;
        __syncthreads();
    }
    for (int j = tid; j < vdim; j += blockDim.x) {
        const float* wv = wk + (size_t)(nope + j) * lora;
        float a = 0.f;
        for (int c = 0; c < lora; ++c) a += wv[c] * o_lat[c];
        out[((size_t)t * heads + h) * vdim + j] = f2bf(a / l);
    }
}

// How attention reads cached K/V: `at(slot, kvh, i)` is element i of KV head kvh in cache row `slot`.
// bf16 rows here; FP8 rows with per-(row, head) scales in kv_fp8.cu.
struct KvBf16 {
    const bf16* rows;
    int width, head_dim;
    __device__ __forceinline__ float at(size_t slot, int kvh, int i) const {
        return bf2f(rows[slot * width + (size_t)kvh * head_dim + i]);
    }
};

// GQA attention of one (token, head) against its sequence's paged cache, positions lo..=pos (lo = 0, or
// pos - window + 1 for a sliding-window layer: window > 0), with an online softmax over tiles of
// blockDim.x positions. grid: (tokens, heads); block: 128 threads; head_dim <= 256.
// q: [tokens, heads, head_dim] f32; caches: [blocks*block_size, kv_heads*head_dim]; out bf16 [tokens, heads*head_dim].
template <typename KV>
__device__ void paged_attention_rows(const float* q, KV kc, KV vc, const int* block_tables, int max_blocks,
                                     const int* seq_of_token, const int* pos_of_token, int heads, int kv_heads,
                                     int head_dim, int block_size, float scale, int window, int row0, bf16* out) {
    extern __shared__ float smem[];  // q (head_dim) + scores (blockDim.x)
    __shared__ float buf[32];
    float* qs = smem;
    float* sc = smem + head_dim;
    int t = blockIdx.x + row0, h = blockIdx.y, tid = threadIdx.x;
    int kvh = h / (heads / kv_heads);
    const int* table = block_tables + (size_t)seq_of_token[t] * max_blocks;
    int pos = pos_of_token[t];
    for (int i = tid; i < head_dim; i += blockDim.x) qs[i] = q[((size_t)t * heads + h) * head_dim + i];
    __syncthreads();
    float m = -INFINITY, l = 0.f;
    float acc0 = 0.f, acc1 = 0.f;  // output dims tid and tid + blockDim.x
    int lo = window > 0 ? max(0, pos - window + 1) : 0;
    for (int base = lo; base <= pos; base += blockDim.x) {
        int p = base + tid;
        float s = -INFINITY;
        if (p <= pos) {
            size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
            float dot = 0.f;
            for (int i = 0; i < head_dim; ++i) dot += qs[i] * kc.at(slot, kvh, i);
            s = dot * scale;
        }
        float tile_max = block_max(s, buf);
        float m_new = fmaxf(m, tile_max);
        float corr = __expf(m - m_new);
        float e = (p <= pos) ? __expf(s - m_new) : 0.f;
        sc[tid] = e;
        float tile_sum = block_sum(e, buf);
        l = l * corr + tile_sum;
        acc0 *= corr;
        acc1 *= corr;
        int n = min((int)blockDim.x, pos - base + 1);
        for (int j = 0; j < n; ++j) {
            int pj = base + j;
            size_t slot = (size_t)table[pj / block_size] * block_size + pj % block_size;
            float w = sc[j];
            if (tid < head_dim) acc0 += w * vc.at(slot, kvh, tid);
            if (tid + blockDim.x < head_dim) acc1 += w * vc.at(slot, kvh, tid + blockDim.x);
        }
        m = m_new;
        __syncthreads();
    }
    bf16* o = out + ((size_t)t * heads + h) * head_dim;
    if (tid < head_dim) o[tid] = f2bf(acc0 / l);
    if (tid + blockDim.x < head_dim) o[tid + blockDim.x] = f2bf(acc1 / l);
}

extern "C" __global__ void paged_attention(const float* q, const bf16* k_cache, const bf16* v_cache,
                                           const int* block_tables, int max_blocks, const int* seq_of_token,
                                           const int* pos_of_token, int heads, int kv_heads, int head_dim,
                                           int block_size, float scale, int window, int row0, bf16* out) {
    int width = kv_heads * head_dim;
    paged_attention_rows(q, KvBf16{k_cache, width, head_dim}, KvBf16{v_cache, width, head_dim}, block_tables,
                         max_blocks, seq_of_token, pos_of_token, heads, kv_heads, head_dim, block_size, scale,
                         window, row0, out);
}

// act = f(gate) * up -> bf16, from gate_up [rows, 2*inter] (gate first). act: 0 silu (SwiGLU), 1 gelu_tanh,
// 2 relu (ReGLU). limit: GLM's swiglu_limit (gate clamped to <= limit, up to [-limit, limit] first);
// INFINITY for none.
extern "C" __global__ void gated_mul(const float* gate_up, int inter, int rows, int act, float limit,
                                     bf16* out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * inter) return;
    size_t r = i / inter, c = i % inter;
    float g = fminf(gate_up[r * 2 * inter + c], limit);
    float u = fmaxf(fminf(gate_up[r * 2 * inter + inter + c], limit), -limit);
    float a = act == 1   ? 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)))
              : act == 2 ? fmaxf(g, 0.f)
                         : g / (1.f + __expf(-g));
    out[i] = f2bf(a * u);
}

// y[i] += x[i] (+ bias[i % cols] if bias)
extern "C" __global__ void add_inplace(float* y, const float* x, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}
extern "C" __global__ void add_bias(float* y, const float* bias, int cols, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += bias[i % cols];
}

// x[t] = embed[ids[t]] as f32
extern "C" __global__ void embed_rows(const bf16* table, const int* ids, int dim, float* x) {
    int t = blockIdx.x;
    const bf16* row = table + (size_t)ids[t] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) x[(size_t)t * dim + i] = bf2f(row[i]);
}

// Gathers rows `idx` of src (bf16 [*, dim]) into dst [count, dim].
extern "C" __global__ void gather_rows(const bf16* src, const int* idx, int dim, bf16* dst) {
    int r = blockIdx.x;
    const bf16* s = src + (size_t)idx[r] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[(size_t)r * dim + i] = s[i];
}

// out[t] += sum over rows r of token t (CSR: rows[offsets[t]..offsets[t+1]]) of w[r] * y[r].
// One block per token and a fixed summation order (fused multiply-adds, as `routed_combine` sums the
// device-routed experts): deterministic, no atomics.
extern "C" __global__ void scatter_add_weighted(const float* y, const int* offsets, const int* rows, const float* w,
                                                int dim, float* out) {
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float acc = 0.f;
        for (int j = offsets[t]; j < offsets[t + 1]; ++j) acc = fmaf(w[rows[j]], y[(size_t)rows[j] * dim + i], acc);
        out[(size_t)t * dim + i] += acc;
    }
}

// y[t] *= sigmoid(dot(gate_w, x[t])) (Qwen2-MoE shared expert gate); one block per token.
extern "C" __global__ void sigmoid_gate_rows(float* y, const float* x, const float* gate_w, int dim) {
    __shared__ float buf[32];
    int t = blockIdx.x;
    float d = 0.f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) d += gate_w[i] * x[(size_t)t * dim + i];
    d = block_sum(d, buf);
    float g = 1.f / (1.f + __expf(-d));
    for (int i = threadIdx.x; i < dim; i += blockDim.x) y[(size_t)t * dim + i] *= g;
}

// Router top-k from f32 logits [tokens, experts]; one thread per token. The reference for `router_topk`
// (the GPU tests compare the two); kept for that.
// kind 0: softmax -> top-k (renorm optional); kind 1: sigmoid, selection on scores + bias with
// group-limited top-k, weights = unbiased scores (renorm optional) * scaling.
extern "C" __global__ void router_topk_serial(const float* logits, int tokens, int experts, int k, int kind, int renorm,
                                       const float* bias, int n_group, int topk_group, float scaling,
                                       int* ids, float* weights) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* l = logits + (size_t)t * experts;
    float mx = -INFINITY;
    for (int e = 0; e < experts; ++e) mx = fmaxf(mx, l[e]);
    float sum = 0.f;
    if (kind == 0) for (int e = 0; e < experts; ++e) sum += __expf(l[e] - mx);
    // group mask: bit g set when group g is kept (n_group <= 64)
    unsigned long long keep = ~0ull;
    if (kind == 1 && n_group > 1) {
        int per = experts / n_group;
        keep = 0;
        for (int r = 0; r < topk_group; ++r) {
            float best = -INFINITY; int bg = -1;
            for (int g = 0; g < n_group; ++g) {
                if (keep >> g & 1ull) continue;
                float a = -INFINITY, b = -INFINITY;  // top-2 biased scores in group g
                for (int e = g * per; e < (g + 1) * per; ++e) {
                    float s = 1.f / (1.f + __expf(-l[e])) + (bias ? bias[e] : 0.f);
                    if (s > a) { b = a; a = s; } else if (s > b) b = s;
                }
                float gs = per > 1 ? a + b : a;
                if (gs > best) { best = gs; bg = g; }
            }
            keep |= 1ull << bg;
        }
    }
    float wsum = 0.f;
    for (int j = 0; j < k; ++j) {
        float best = -INFINITY; int be = -1;
        for (int e = 0; e < experts; ++e) {
            bool taken = false;
            for (int i = 0; i < j; ++i) taken |= ids[(size_t)t * k + i] == e;
            if (taken) continue;
            if (kind == 1 && n_group > 1 && !(keep >> (e / (experts / n_group)) & 1ull)) continue;
            float s = kind == 0 ? l[e] : 1.f / (1.f + __expf(-l[e])) + (bias ? bias[e] : 0.f);
            if (s > best) { best = s; be = e; }
        }
        ids[(size_t)t * k + j] = be;
        float w = kind == 0 ? __expf(l[be] - mx) / sum : 1.f / (1.f + __expf(-l[be]));
        weights[(size_t)t * k + j] = w;
        wsum += w;
    }
    for (int j = 0; j < k; ++j) {
        float w = weights[(size_t)t * k + j];
        if (renorm) w = kind == 0 ? w / wsum : w / (wsum + 1e-20f);
        weights[(size_t)t * k + j] = kind == 1 ? w * scaling : w;
    }
}

extern "C" __global__ void f32_to_bf16(const float* x, size_t n, bf16* y) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2bf(x[i]);
}

// ---- long prefill: attention as two cuBLAS GEMMs around this softmax (see gpu/attention.rs) ----

// One sequence's cached K and V rows 0..len (paged bf16) → contiguous bf16 [len, width] (GEMM inputs).
extern "C" __global__ void gather_kv_bf16(const bf16* k_cache, const bf16* v_cache, const int* table,
                                          int block_size, int width, int v_width, bf16* k_out, bf16* v_out) {
    int p = blockIdx.x;
    size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
    for (int i = threadIdx.x; i < width; i += blockDim.x) k_out[(size_t)p * width + i] = k_cache[slot * width + i];
    for (int i = threadIdx.x; i < v_width; i += blockDim.x) v_out[(size_t)p * v_width + i] = v_cache[slot * v_width + i];
}

// Causal softmax of scaled scores s [rows, lk] (row r = query at absolute position q_pos0 + r % rows_per_head;
// keys 0..lk at positions 0..lk) → probabilities p (bf16, masked keys exactly 0). window > 0: keys before
// q - window + 1 are masked too (sliding-window layers). One block per row.
extern "C" __global__ void causal_softmax_rows(const float* s, int lk, int rows_per_head, int q_pos0, int window,
                                               bf16* p) {
    __shared__ float buf[32];
    size_t row = blockIdx.x;
    int qpos = q_pos0 + (int)(row % rows_per_head);
    int valid = min(lk, qpos + 1);
    int lo = window > 0 ? max(0, qpos - window + 1) : 0;
    const float* sr = s + row * lk;
    bf16* pr = p + row * lk;
    float m = -INFINITY;
    for (int c = lo + threadIdx.x; c < valid; c += blockDim.x) m = fmaxf(m, sr[c]);
    m = block_max(m, buf);
    float sum = 0.f;
    for (int c = lo + threadIdx.x; c < valid; c += blockDim.x) sum += __expf(sr[c] - m);
    sum = block_sum(sum, buf);
    float inv = 1.f / sum;
    for (int c = threadIdx.x; c < lk; c += blockDim.x)
        pr[c] = (c >= lo && c < valid) ? f2bf(__expf(sr[c] - m) * inv) : (bf16)0;
}

// ---- layerwise prefill: packed DRAM experts (copied as they sit in host memory) → dense bf16 ----

__device__ float fp8_e4m3(unsigned char b) {
    float sign = (b & 0x80) ? -1.f : 1.f;
    int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return __int_as_float(0x7fc00000);
    if (e == 0) return sign * ldexpf((float)m, -9);
    return sign * ldexpf(1.f + m * 0.125f, e - 7);
}

// Expert blockIdx.y of a chunk, matrix blockIdx.z (0 gate, 1 up, 2 down) → dense[expert] =
// [gate; up] rows ([2*inter, hidden]) then down ([hidden, inter]); matrix z starts at z*inter*hidden.
// The index formulas are those of `MatRef::weight` (kernels/src/cpu/moe/pack.rs: the packed tile layout);
// the GPU tests check this kernel bit for bit against `unpack_bf16`, which reads the bytes with it. fmt: 0 bf16,
// 1 fp8 e4m3 + 128x128 block scales, 2 int8 + row scales, 3 int4 (u - 8) * d and 4 int4 u * d + m with f16
// d (and m) per `group` inputs of a row (GGUF Q4_0 / Q4_1 / Q4_K experts, `--expert-dtype int4`).
extern "C" __global__ void unpack_experts(const unsigned char* packed, long long expert_bytes, int fmt, int group,
                                          int inter,
                                          int hidden, int gate_ktiles, long long gate_wbytes, long long gate_bytes,
                                          int down_ktiles, long long down_wbytes, bf16* dense) {
    int e = blockIdx.y, mat = blockIdx.z;
    int rows = mat == 2 ? hidden : inter, cols = mat == 2 ? inter : hidden;
    int ktiles = mat == 2 ? down_ktiles : gate_ktiles;
    long long wbytes = mat == 2 ? down_wbytes : gate_wbytes;
    const unsigned char* m = packed + (long long)e * expert_bytes + (long long)mat * gate_bytes;
    const float* scales = (const float*)(m + wbytes);
    bf16* out = dense + (size_t)e * 3 * inter * hidden + (size_t)mat * inter * hidden;
    size_t total = (size_t)rows * cols;
    int kblocks = (cols + 127) / 128;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (size_t)gridDim.x * blockDim.x) {
        int n = (int)(idx / cols), k = (int)(idx % cols);
        int nt = n >> 4, j = n & 15;
        if (fmt == 0) {
            int ti = k >> 5, kin = k & 31;
            size_t o = (size_t)(nt * ktiles + ti) * 512 + (kin >> 1) * 32 + j * 2 + (kin & 1);
            out[idx] = ((const bf16*)m)[o];
        } else if (fmt == 1) {
            int ti = k >> 5, kin = k & 31;
            size_t o = (size_t)(nt * ktiles + ti) * 512 + (kin >> 1) * 32 + j * 2 + (kin & 1);
            out[idx] = f2bf(fp8_e4m3(m[o]) * scales[(n / 128) * kblocks + k / 128]);
        } else if (fmt == 2) {
            int ti = k >> 6, kin = k & 63;
            size_t o = (size_t)(nt * ktiles + ti) * 1024 + (kin >> 2) * 64 + j * 4 + (kin & 3);
            out[idx] = f2bf((float)((int)m[o] - 128) * scales[n]);
        } else {
            // int4 tiles: 64 inputs of 16 rows in 512 bytes; input-quad kk's low (even kk) or high nibble
            int ti = k >> 6, kin = k & 63, kk = kin >> 2;
            unsigned char b = m[(size_t)(nt * ktiles + ti) * 512 + (kk >> 1) * 64 + j * 4 + (kin & 3)];
            int u = (kk & 1) ? (b >> 4) : (b & 15);
            const unsigned short* s16 = (const unsigned short*)scales;
            size_t g = (size_t)nt * (ktiles * 64 / group) + k / group;
            // no fused multiply-add: the CPU reader rounds the product, then the sum
            out[idx] = fmt == 3 ? f2bf((float)(u - 8) * h2f(s16[g * 16 + j]))
                                : f2bf(__fadd_rn(__fmul_rn((float)u, h2f(s16[g * 32 + j])), h2f(s16[g * 32 + 16 + j])));
        }
    }
}

// (value, index) argmax across a block; ties go to the lower index (as the serial loop's strict >).
__device__ void block_argmax(float& v, int& i, float* vbuf, int* ibuf) {
    for (int o = WARP / 2; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffff, v, o);
        int i2 = __shfl_xor_sync(0xffffffff, i, o);
        if (v2 > v || (v2 == v && i2 >= 0 && (i < 0 || i2 < i))) { v = v2; i = i2; }
    }
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    __syncthreads();
    if (lane == 0) { vbuf[wid] = v; ibuf[wid] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        int nw = (blockDim.x + WARP - 1) / WARP;
        for (int w = 1; w < nw; ++w)
            if (vbuf[w] > vbuf[0] || (vbuf[w] == vbuf[0] && ibuf[w] >= 0 && (ibuf[0] < 0 || ibuf[w] < ibuf[0]))) {
                vbuf[0] = vbuf[w]; ibuf[0] = ibuf[w];
            }
    }
    __syncthreads();
    v = vbuf[0]; i = ibuf[0];
    __syncthreads();
}

// Top-k of one token's logits `l` into ids[0..k], weights[0..k] (router_topk_serial's contract), by
// the whole block (blockDim.x >= k). `sm`: 2 * experts floats of shared memory.
__device__ void router_topk_row(const float* l, int experts, int k, int kind, int renorm, const float* bias,
                                int n_group, int topk_group, float scaling, int* ids, float* weights, float* sm) {
    __shared__ float vbuf[32];
    __shared__ int ibuf[32];
    __shared__ unsigned long long keep;
    float* sel = sm;            // selection score (-inf once taken or masked)
    float* val = sm + experts;  // weight before renormalisation
    int tid = threadIdx.x;
    float mx = -INFINITY;
    for (int e = tid; e < experts; e += blockDim.x) mx = fmaxf(mx, l[e]);
    mx = block_max(mx, vbuf);
    float sum = 0.f;
    if (kind == 0) {
        for (int e = tid; e < experts; e += blockDim.x) sum += __expf(l[e] - mx);
        sum = block_sum(sum, vbuf);
    }
    for (int e = tid; e < experts; e += blockDim.x) {
        if (kind == 0) {
            sel[e] = l[e];
            val[e] = __expf(l[e] - mx) / sum;
        } else {
            float sg = 1.f / (1.f + __expf(-l[e]));
            val[e] = sg;
            sel[e] = sg + (bias ? bias[e] : 0.f);
        }
    }
    __syncthreads();
    if (kind == 1 && n_group > 1) {
        // groups: score = sum of the top-2 biased scores (top-1 if one expert per group); keep topk_group
        if (tid == 0) {
            int per = experts / n_group;
            unsigned long long kp = 0;
            for (int r = 0; r < topk_group; ++r) {
                float best = -INFINITY; int bg = -1;
                for (int g = 0; g < n_group; ++g) {
                    if (kp >> g & 1ull) continue;
                    float a = -INFINITY, b = -INFINITY;
                    for (int e = g * per; e < (g + 1) * per; ++e) {
                        float s = sel[e];
                        if (s > a) { b = a; a = s; } else if (s > b) b = s;
                    }
                    float gs = per > 1 ? a + b : a;
                    if (gs > best) { best = gs; bg = g; }
                }
                kp |= 1ull << bg;
            }
            keep = kp;
        }
        __syncthreads();
        int per = experts / n_group;
        for (int e = tid; e < experts; e += blockDim.x)
            if (!(keep >> (e / per) & 1ull)) sel[e] = -INFINITY;
        __syncthreads();
    }
    float wsum = 0.f;
    for (int j = 0; j < k; ++j) {
        float v = -INFINITY; int bi = -1;
        for (int e = tid; e < experts; e += blockDim.x)
            if (sel[e] > v || (bi < 0 && sel[e] == v)) { v = sel[e]; bi = e; }
        block_argmax(v, bi, vbuf, ibuf);
        if (tid == 0) {
            ids[j] = bi;
            weights[j] = val[bi];
            sel[bi] = -INFINITY;
        }
        wsum += val[bi];
        __syncthreads();
    }
    if (tid < k) {
        float w = weights[tid];
        if (renorm) w = kind == 0 ? w / wsum : w / (wsum + 1e-20f);
        weights[tid] = kind == 1 ? w * scaling : w;
    }
}

// Router top-k, same contract as router_topk_serial, one block per token (decode: one token's 8 rounds
// over 128+ experts would otherwise run on a single GPU thread, tens of µs per layer).
// Dynamic shared memory: 2 * experts floats.
extern "C" __global__ void router_topk(const float* logits, int tokens, int experts, int k, int kind, int renorm,
                                       const float* bias, int n_group, int topk_group, float scaling,
                                       int* ids, float* weights) {
    extern __shared__ float sm[];
    int t = blockIdx.x;
    router_topk_row(logits + (size_t)t * experts, experts, k, kind, renorm, bias, n_group, topk_group, scaling,
                    ids + (size_t)t * k, weights + (size_t)t * k, sm);
}
