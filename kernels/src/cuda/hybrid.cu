// CUDA kernels of hybrid-attention models (GLM-5.3-Flash, GLM-5): KDA linear attention, hyper-connections,
// the sparse-attention indexer and MLA over selected positions. A module of its own (compiled by NVRTC
// only for models that need it) after `common.cuh`'s helpers. All f32 unless a name says bf16.
//
// Step layout shared by the kernels: a step's rows are grouped by sequence ("segments", consecutive
// rows); seg_row0[s] / seg_len[s] give segment s's rows and seg_of_row[t] the segment of row t.
// Recurrent states: `states[s]` is the device address of segment s's state buffer (all linear layers of
// one sequence, f32); a layer's part starts `layer_off` floats in: [heads, d, d] matrices, then the
// convolution tail [kernel - 1, 3 * heads * d].
__device__ __forceinline__ float hy_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Exclusive prefix sum of one int per thread over the block; `buf` is 32 ints; returns the total in *total.
__device__ int hy_block_scan(int v, int* buf, int* total) {
    int lane = threadIdx.x % 32, wid = threadIdx.x / 32;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffff, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) buf[wid] = x;
    __syncthreads();
    if (wid == 0) {
        int nw = (blockDim.x + 31) / 32;
        int w = lane < nw ? buf[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffff, w, o);
            if (lane >= o) w += y;
        }
        buf[lane] = w;  // inclusive per warp
    }
    __syncthreads();
    int before = (wid > 0 ? buf[wid - 1] : 0) + x - v;
    *total = buf[(blockDim.x + 31) / 32 - 1];
    __syncthreads();
    return before;
}
__device__ __forceinline__ float hy_act(int act, float g) {
    return act == 1   ? 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)))
           : act == 2 ? fmaxf(g, 0.f)
                      : g / (1.f + expf(-g));
}

// ---------------------------------------------------------------------------------------------------
// KDA linear attention

// Depthwise causal convolution + activation (0 SiLU, 1 GELU-tanh, 2 ReLU) of each row's `ch` channels:
// out[t][c] = act(sum_j w[c][j] * seq[i + j][c]) where seq is the segment's tail (kern - 1 rows) then
// its rows, i the row's index in its segment. grid: (rows, ceil(ch / 256)); block 256.
extern "C" __global__ void kda_conv(const float* x, int ch, int kern, const float* w, const int* seg_of_row,
                                    const int* seg_row0, const unsigned long long* states, long long conv_off,
                                    int act, float* out) {
    int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    int s = seg_of_row[t], i = t - seg_row0[s];
    const float* tail = (const float*)states[s] + conv_off;
    float acc = 0.f;
    for (int j = 0; j < kern; ++j) {
        int q = i + j;  // index in seq
        float v = q < kern - 1 ? tail[(size_t)q * ch + c] : x[(size_t)(t + j - (kern - 1)) * ch + c];
        acc += w[(size_t)c * kern + j] * v;
    }
    out[(size_t)t * ch + c] = hy_act(act, acc);
}

// Advances each segment's convolution tail to the segment's last kern - 1 inputs (run after kda_conv,
// which reads the old tail). grid: (segments, ceil(ch / 256)); block 256.
extern "C" __global__ void kda_conv_tail(const float* x, int ch, int kern, const int* seg_row0, const int* seg_len,
                                         const unsigned long long* states, long long conv_off) {
    int s = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= ch) return;
    float* tail = (float*)states[s] + conv_off;
    int len = seg_len[s], row0 = seg_row0[s];
    // row r takes seq[len + r]; ascending r reads each old tail row before it is overwritten
    for (int r = 0; r < kern - 1; ++r) {
        int q = len + r;
        float v = q < kern - 1 ? tail[(size_t)q * ch + c] : x[(size_t)(row0 + q - (kern - 1)) * ch + c];
        tail[(size_t)r * ch + c] = v;
    }
}

// Per (row, head): q and k L2-normalised (x / sqrt(sum x^2 + 1e-6)), q also scaled by 1/sqrt(d), in place
// in qkv [rows, 3 * heads * d]; g [rows, heads * d] from the forget projection to the log decay
// (bound: lb * sigmoid(exp(A_log) * (g + dt_bias)); else -exp(A_log) * softplus(g + dt_bias));
// beta [rows, heads] through a sigmoid. grid: (rows, heads); block 128.
extern "C" __global__ void kda_prepare(float* qkv, float* g, float* beta, const float* a_log, const float* dt_bias,
                                       int heads, int d, int has_bound, float lower_bound) {
    __shared__ float buf[32];
    int t = blockIdx.x, h = blockIdx.y;
    size_t w = (size_t)heads * d;
    float* q = qkv + (size_t)t * 3 * w + (size_t)h * d;
    float* k = q + w;
    float sq = 0.f, sk = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        sq += q[i] * q[i];
        sk += k[i] * k[i];
    }
    sq = block_sum(sq, buf);
    sk = block_sum(sk, buf);
    float iq = rsqrtf(sq + 1e-6f) * rsqrtf((float)d), ik = rsqrtf(sk + 1e-6f);
    float rate = expf(a_log[h]);
    float* gh = g + (size_t)t * w + (size_t)h * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        q[i] *= iq;
        k[i] *= ik;
        float raw = gh[i] + dt_bias[(size_t)h * d + i];
        gh[i] = has_bound ? lower_bound * hy_sigmoid(rate * raw)
                          : -rate * (raw > 20.f ? raw : log1pf(expf(raw)));
    }
    if (threadIdx.x == 0) beta[(size_t)t * heads + h] = hy_sigmoid(beta[(size_t)t * heads + h]);
}

// The gated delta rule token by token, for every segment and head: per token
//   S <- diag(exp g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
// with S [d (key), d (value)] in the segment's state. Value columns are independent: each thread keeps
// up to 32 rows of one column in registers; `parts` (1, 2 or 4: d <= 32, 64, 128) adjacent lanes share a
// column.
// grid: (segments, heads, ceil(d / (128 / parts))); block 128; d <= 128.
#define KDA_ROWS 32
// One thread's share of a head's state S [d (key), d (value)] in the KDA kernels: value column `col`,
// rows part, part + parts, … (up to KDA_ROWS of them) in registers; `parts` (1, 2 or 4: d <= 32, 64,
// 128) adjacent lanes share a column, 128 / parts columns per block (blockIdx.z picks which).
struct KdaColumn {
    int parts, part, col;
    bool active;
    float* S;
};
__device__ __forceinline__ KdaColumn kda_column(int d, int heads, const unsigned long long* states,
                                                long long layer_off) {
    KdaColumn k;
    k.parts = d <= 32 ? 1 : d <= 64 ? 2 : 4;
    k.part = threadIdx.x % k.parts;
    k.col = blockIdx.z * (blockDim.x / k.parts) + threadIdx.x / k.parts;
    k.active = k.col < d;
    k.S = (float*)states[blockIdx.x] + layer_off + (size_t)blockIdx.y * d * d;
    return k;
}
__device__ __forceinline__ void kda_state_load(const KdaColumn& k, int d, float* reg) {
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        int i = k.part + k.parts * r;
        reg[r] = (k.active && i < d) ? k.S[(size_t)i * d + k.col] : 0.f;
    }
}
__device__ __forceinline__ void kda_state_store(const KdaColumn& k, int d, const float* reg) {
#pragma unroll
    for (int r = 0; r < KDA_ROWS; ++r) {
        int i = k.part + k.parts * r;
        if (k.active && i < d) k.S[(size_t)i * d + k.col] = reg[r];
    }
}
extern "C" __global__ void kda_recurrent(const float* qkv, const float* g, const float* beta, int heads, int d,
                                         const int* seg_row0, const int* seg_len,
                                         const unsigned long long* states, long long layer_off, float* out) {
    __shared__ float sq[128], sk[128], sg[128];
    KdaColumn kc = kda_column(d, heads, states, layer_off);
    int parts = kc.parts, part = kc.part, col = kc.col, tid = threadIdx.x;
    bool active = kc.active;
    int s = blockIdx.x, h = blockIdx.y;
    size_t w = (size_t)heads * d;
    float reg[KDA_ROWS];
    kda_state_load(kc, d, reg);
    int row0 = seg_row0[s], len = seg_len[s];
    for (int tt = 0; tt < len; ++tt) {
        size_t t = (size_t)row0 + tt;
        const float* qt = qkv + t * 3 * w + (size_t)h * d;
        for (int i = tid; i < d; i += blockDim.x) {
            sq[i] = qt[i];
            sk[i] = qt[w + i];
            sg[i] = expf(g[t * w + (size_t)h * d + i]);
        }
        __syncthreads();
        float mem = 0.f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            int i = part + parts * r;
            if (i < d) {
                reg[r] *= sg[i];
                mem += reg[r] * sk[i];
            }
        }
        for (int o = 1; o < parts; o <<= 1) mem += __shfl_xor_sync(0xffffffff, mem, o);
        float v = active ? qt[2 * w + col] : 0.f;
        float delta = beta[t * heads + h] * (v - mem);
        float o_acc = 0.f;
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            int i = part + parts * r;
            if (i < d) {
                reg[r] += sk[i] * delta;
                o_acc += reg[r] * sq[i];
            }
        }
        for (int o = 1; o < parts; o <<= 1) o_acc += __shfl_xor_sync(0xffffffff, o_acc, o);
        if (active && part == 0) out[t * w + (size_t)h * d + col] = o_acc;
        __syncthreads();
    }
    kda_state_store(kc, d, reg);
}

// The same recurrence in chunks of KDA_CHUNK tokens (the WY / chunked form of fla's `chunk_kda` and
// transformers' `chunk_kimi_delta_attention`), in two passes. Per chunk, with G the within-chunk
// cumulative log decay (G_i = g_0 + ... + g_i):
//   A[i][j] = -beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])   (j < i), T = (I - A)^-1 by substitution,
//   W = T (beta k exp G),  QK[i][j] = sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])   (j <= i)
// depend on q, k, g and beta only: kda_chunk_prep computes them for every chunk of every segment and head
// at once (one block each). kda_chunk_scan then walks each segment's chunks in order, carrying S:
//   U = T (beta v),  v_new = U - W S,  o_i = (q_i exp G_i) S + sum_{j<=i} QK[i][j] v_new_j,
//   S <- exp(G_last) S + sum_i (k_i exp(G_last - G_i)) v_new_i^T.
// Every exponent is a decay over at most one chunk (<= 0), so nothing overflows. A partial last chunk is
// padded with zero k, v and beta, whose W, T and v_new rows are zero: outputs and state stay as they are.
// The per-chunk terms live in `scratch`, laid out by the chunk's rows (3 * heads * d floats per row, the
// size of the q/k/v rows): row t holds W[t] for every head ([heads, d]), then per head 2d floats whose
// first 2 * KDA_CHUNK are T's row and QK's row (so d >= KDA_CHUNK). Only real rows are written.
#define KDA_CHUNK 16
__device__ __forceinline__ size_t kda_w_at(size_t t, size_t w, int h, int d) { return t * 3 * w + (size_t)h * d; }
__device__ __forceinline__ size_t kda_tq_at(size_t t, size_t w, int h, int d) {
    return t * 3 * w + w + (size_t)h * 2 * d;
}

// grid: (ceil(longest segment / KDA_CHUNK), segments, heads); block 128; KDA_CHUNK <= d <= 128.
extern "C" __global__ void kda_chunk_prep(const float* qkv, const float* g, const float* beta, int heads, int d,
                                          const int* seg_row0, const int* seg_len, float* scratch) {
    __shared__ float sq[KDA_CHUNK][128];
    __shared__ float sk[KDA_CHUNK][128];
    __shared__ float sG[KDA_CHUNK][128];
    __shared__ float sT[KDA_CHUNK][KDA_CHUNK + 1];  // A, then T in place
    __shared__ float sQK[KDA_CHUNK][KDA_CHUNK + 1], sb[KDA_CHUNK];
    int s = blockIdx.y, h = blockIdx.z, tid = threadIdx.x;
    int c0 = blockIdx.x * KDA_CHUNK, len = seg_len[s];
    if (c0 >= len) return;
    int n = min(KDA_CHUNK, len - c0);
    size_t r0 = (size_t)seg_row0[s] + c0, w = (size_t)heads * d;
    for (int c = tid; c < d; c += blockDim.x) {
        float G = 0.f;
        for (int i = 0; i < KDA_CHUNK; ++i) {
            bool real = i < n;
            size_t t = r0 + i;
            sq[i][c] = real ? qkv[t * 3 * w + (size_t)h * d + c] : 0.f;
            sk[i][c] = real ? qkv[t * 3 * w + w + (size_t)h * d + c] : 0.f;
            G += real ? g[t * w + (size_t)h * d + c] : 0.f;
            sG[i][c] = G;
        }
    }
    if (tid < KDA_CHUNK) sb[tid] = tid < n ? beta[(r0 + tid) * heads + h] : 0.f;
    __syncthreads();
    // the decayed k·k and q·k products: one warp per (i, j), lanes over channels
    int lane = tid % WARP, wid = tid / WARP, nw = blockDim.x / WARP;
    for (int p = wid; p < KDA_CHUNK * KDA_CHUNK; p += nw) {
        int i = p / KDA_CHUNK, j = p % KDA_CHUNK;
        float a = 0.f, qk = 0.f;
        if (j <= i) {  // uniform over the warp
            for (int c = lane; c < d; c += WARP) {
                float e = expf(sG[i][c] - sG[j][c]) * sk[j][c];
                a += sk[i][c] * e;
                qk += sq[i][c] * e;
            }
            a = warp_sum(a);
            qk = warp_sum(qk);
        }
        if (lane == 0) {
            sT[i][j] = j < i ? -sb[i] * a : 0.f;
            sQK[i][j] = qk;
        }
    }
    __syncthreads();
    // T = (I - A)^-1 row by row: T[i][j] = A[i][j] + sum_{j < m < i} A[i][m] T[m][j] (diagonal 1 implied)
    if (wid == 0) {
        for (int i = 1; i < KDA_CHUNK; ++i) {
            float v = 0.f;
            if (lane < i) {
                v = sT[i][lane];
                for (int m = lane + 1; m < i; ++m) v += sT[i][m] * sT[m][lane];
            }
            __syncwarp();
            if (lane < i) sT[i][lane] = v;
            __syncwarp();
        }
    }
    __syncthreads();
    for (int c = tid; c < d; c += blockDim.x) {
        float bk[KDA_CHUNK];
#pragma unroll
        for (int j = 0; j < KDA_CHUNK; ++j) bk[j] = sb[j] * sk[j][c] * expf(sG[j][c]);
#pragma unroll
        for (int i = 0; i < KDA_CHUNK; ++i) {
            float acc = bk[i];
#pragma unroll
            for (int j = 0; j < i; ++j) acc += sT[i][j] * bk[j];
            if (i < n) scratch[kda_w_at(r0 + i, w, h, d) + c] = acc;
        }
    }
    for (int p = tid; p < n * 2 * KDA_CHUNK; p += blockDim.x) {
        int i = p / (2 * KDA_CHUNK), j = p % (2 * KDA_CHUNK);
        float v = j < KDA_CHUNK ? (j < i ? sT[i][j] : 0.f) : sQK[i][j - KDA_CHUNK];
        scratch[kda_tq_at(r0 + i, w, h, d) + j] = v;
    }
}

// The sequential pass over each segment's chunks, value columns independent as in kda_recurrent (same
// register layout of S). grid: (segments, heads, ceil(d / (128 / parts))); block 128; KDA_CHUNK <= d <= 128.
extern "C" __global__ void kda_chunk_scan(const float* qkv, const float* g, const float* beta, int heads, int d,
                                          const int* seg_row0, const int* seg_len,
                                          const unsigned long long* states, long long layer_off,
                                          const float* scratch, float* out) {
    __shared__ float sq[KDA_CHUNK][128];  // q exp(G)
    __shared__ float sk[KDA_CHUNK][128];  // k exp(G_last - G)
    __shared__ float sW[KDA_CHUNK][128];
    __shared__ float sT[KDA_CHUNK][KDA_CHUNK], sQK[KDA_CHUNK][KDA_CHUNK], sb[KDA_CHUNK], sdecay[128];
    KdaColumn kc = kda_column(d, heads, states, layer_off);
    int parts = kc.parts, part = kc.part, col = kc.col, tid = threadIdx.x;
    bool active = kc.active;
    int s = blockIdx.x, h = blockIdx.y;
    size_t w = (size_t)heads * d;
    float reg[KDA_ROWS];
    kda_state_load(kc, d, reg);
    int row0 = seg_row0[s], len = seg_len[s];
    for (int c0 = 0; c0 < len; c0 += KDA_CHUNK) {
        int n = min(KDA_CHUNK, len - c0);
        size_t r0 = (size_t)row0 + c0;
        for (int c = tid; c < d; c += blockDim.x) {
            float G[KDA_CHUNK], acc = 0.f;
#pragma unroll
            for (int i = 0; i < KDA_CHUNK; ++i) {
                acc += i < n ? g[(r0 + i) * w + (size_t)h * d + c] : 0.f;
                G[i] = acc;
            }
#pragma unroll
            for (int i = 0; i < KDA_CHUNK; ++i) {
                bool real = i < n;
                size_t t = r0 + i;
                sq[i][c] = real ? qkv[t * 3 * w + (size_t)h * d + c] * expf(G[i]) : 0.f;
                sk[i][c] = real ? qkv[t * 3 * w + w + (size_t)h * d + c] * expf(acc - G[i]) : 0.f;
                sW[i][c] = real ? scratch[kda_w_at(t, w, h, d) + c] : 0.f;
            }
            sdecay[c] = expf(acc);
        }
        for (int p = tid; p < KDA_CHUNK * 2 * KDA_CHUNK; p += blockDim.x) {
            int i = p / (2 * KDA_CHUNK), j = p % (2 * KDA_CHUNK);
            float v = i < n ? scratch[kda_tq_at(r0 + i, w, h, d) + j] : 0.f;
            if (j < KDA_CHUNK)
                sT[i][j] = v;
            else
                sQK[i][j - KDA_CHUNK] = v;
        }
        if (tid < KDA_CHUNK) sb[tid] = tid < n ? beta[(r0 + tid) * heads + h] : 0.f;
        __syncthreads();
        // value column `col`: U = T (beta v), v_new = U - W S, outputs, then the state
        float vb[KDA_CHUNK], vn[KDA_CHUNK];
#pragma unroll
        for (int j = 0; j < KDA_CHUNK; ++j)
            vb[j] = (active && j < n) ? sb[j] * qkv[(r0 + j) * 3 * w + 2 * w + (size_t)h * d + col] : 0.f;
#pragma unroll
        for (int i = 0; i < KDA_CHUNK; ++i) {
            float u = vb[i];
#pragma unroll
            for (int j = 0; j < i; ++j) u += sT[i][j] * vb[j];
            float ws = 0.f;
#pragma unroll
            for (int r = 0; r < KDA_ROWS; ++r) {
                int row = part + parts * r;
                if (row < d) ws += sW[i][row] * reg[r];
            }
            for (int o = 1; o < parts; o <<= 1) ws += __shfl_xor_sync(0xffffffff, ws, o);
            vn[i] = u - ws;
        }
#pragma unroll
        for (int i = 0; i < KDA_CHUNK; ++i) {
            float o_acc = 0.f;
#pragma unroll
            for (int r = 0; r < KDA_ROWS; ++r) {
                int row = part + parts * r;
                if (row < d) o_acc += sq[i][row] * reg[r];
            }
            for (int o = 1; o < parts; o <<= 1) o_acc += __shfl_xor_sync(0xffffffff, o_acc, o);
#pragma unroll
            for (int j = 0; j <= i; ++j) o_acc += sQK[i][j] * vn[j];
            if (active && part == 0 && i < n) out[(r0 + i) * w + (size_t)h * d + col] = o_acc;
        }
#pragma unroll
        for (int r = 0; r < KDA_ROWS; ++r) {
            int row = part + parts * r;
            if (row < d) {
                float acc = sdecay[row] * reg[r];
#pragma unroll
                for (int i = 0; i < KDA_CHUNK; ++i) acc += sk[i][row] * vn[i];
                reg[r] = acc;
            }
        }
        __syncthreads();
    }
    kda_state_store(kc, d, reg);
}

// Gated RMSNorm per head: out = x / rms(x) * w * sigmoid(gate) -> bf16. x, gate: [rows, heads * d]; w: [d].
// grid: (rows, heads); block 128.
extern "C" __global__ void gated_rms_norm(const float* x, const float* gate, const float* w, int heads, int d,
                                          float eps, bf16* out) {
    __shared__ float buf[32];
    size_t off = ((size_t)blockIdx.x * heads + blockIdx.y) * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += x[off + i] * x[off + i];
    ss = block_sum(ss, buf);
    float inv = rsqrtf(ss / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        out[off + i] = f2bf(x[off + i] * inv * w[i] * hy_sigmoid(gate[off + i]));
}

// ---------------------------------------------------------------------------------------------------
// Hyper-connections: streams [rows, m, hidden]; mix [rows, 2m + m*m] = pre, post, comb of one block.

#define HC_MAX_M 8

// The element-wise stream kernels share one signature (m, hidden, input, second input or null, output)
// and one launch shape. grid: (rows, ceil(hidden / 256)); block 256.

// streams[t][i][c] = x[t][c] for every stream i.
extern "C" __global__ void hc_broadcast(int m, int hidden, const float* x, const float* unused, float* streams) {
    int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float v = x[(size_t)t * hidden + c];
    for (int i = 0; i < m; ++i) streams[((size_t)t * m + i) * hidden + c] = v;
}

// x[t][c] = mean over streams (the hyper head).
extern "C" __global__ void hc_mean(int m, int hidden, const float* streams, const float* unused, float* x) {
    int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float a = 0.f;
    for (int i = 0; i < m; ++i) a += streams[((size_t)t * m + i) * hidden + c];
    x[(size_t)t * hidden + c] = a / m;
}

// A block's input and stream weights. `proj_out` [rows, (2 + m) * m] = streams . fn^T (not yet scaled
// by the streams' 1/rms); base [(2 + m) * m]; scales (pre, post, comb). Writes mix and x = sum pre_i s_i.
// grid: rows; block 256.
extern "C" __global__ void hc_collapse(const float* streams, const float* proj_out, const float* base, float ps,
                                       float qs, float cs, int m, int hidden, int iters, float hc_eps,
                                       float norm_eps, float* mix, float* x) {
    __shared__ float buf[32];
    __shared__ float wsh[2 * HC_MAX_M + HC_MAX_M * HC_MAX_M];
    int t = blockIdx.x;
    size_t width = (size_t)m * hidden;
    const float* s = streams + (size_t)t * width;
    float ss = 0.f;
    for (size_t i = threadIdx.x; i < width; i += blockDim.x) ss += s[i] * s[i];
    ss = block_sum(ss, buf);
    if (threadIdx.x == 0) {
        float inv = rsqrtf(ss / (float)width + norm_eps);
        const float* p = proj_out + (size_t)t * (2 + m) * m;
        float* pre = wsh;
        float* post = wsh + m;
        float* comb = wsh + 2 * m;
        for (int i = 0; i < m; ++i) {
            pre[i] = hy_sigmoid(p[i] * inv * ps + base[i]) + hc_eps;
            post[i] = 2.f * hy_sigmoid(p[m + i] * inv * qs + base[m + i]);
        }
        for (int i = 0; i < m * m; ++i) comb[i] = p[2 * m + i] * inv * cs + base[2 * m + i];
        for (int r = 0; r < m; ++r) {  // row softmax, then + eps
            float mx = -INFINITY;
            for (int j = 0; j < m; ++j) mx = fmaxf(mx, comb[r * m + j]);
            float sum = 0.f;
            for (int j = 0; j < m; ++j) {
                comb[r * m + j] = expf(comb[r * m + j] - mx);
                sum += comb[r * m + j];
            }
            for (int j = 0; j < m; ++j) comb[r * m + j] = comb[r * m + j] / sum + hc_eps;
        }
        // Sinkhorn: columns, then iters - 1 rounds of rows and columns (transformers' order)
        for (int it = 0; it < iters; ++it) {
            if (it > 0) {
                for (int r = 0; r < m; ++r) {
                    float sum = hc_eps;
                    for (int j = 0; j < m; ++j) sum += comb[r * m + j];
                    for (int j = 0; j < m; ++j) comb[r * m + j] /= sum;
                }
            }
            for (int j = 0; j < m; ++j) {
                float sum = hc_eps;
                for (int r = 0; r < m; ++r) sum += comb[r * m + j];
                for (int r = 0; r < m; ++r) comb[r * m + j] /= sum;
            }
        }
        float* mt = mix + (size_t)t * (2 * m + m * m);
        for (int i = 0; i < 2 * m + m * m; ++i) mt[i] = wsh[i];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float a = 0.f;
        for (int i = 0; i < m; ++i) a += wsh[i] * s[(size_t)i * hidden + c];
        x[(size_t)t * hidden + c] = a;
    }
}

// New streams after a block: y = x - sum pre_i s_i (x holds the block input plus the block's output),
// s'_j = post_j y + sum_i comb[i][j] s_i, in place.
extern "C" __global__ void hc_expand(int m, int hidden, const float* x, const float* mix, float* streams) {
    int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    const float* mt = mix + (size_t)t * (2 * m + m * m);
    float* s = streams + (size_t)t * m * hidden;
    float old[HC_MAX_M];
    float xin = 0.f;
    for (int i = 0; i < m; ++i) {
        old[i] = s[(size_t)i * hidden + c];
        xin += mt[i] * old[i];
    }
    float y = x[(size_t)t * hidden + c] - xin;
    for (int j = 0; j < m; ++j) {
        float a = mt[m + j] * y;
        for (int i = 0; i < m; ++i) a += mt[2 * m + i * m + j] * old[i];
        s[(size_t)j * hidden + c] = a;
    }
}

// ---------------------------------------------------------------------------------------------------
// Sparse-attention indexer. Rows of the indexer cache: [slots, width] f32, width = d (key) or 2d (key,
// then the key-pool gate logits, which the pooled key replaces in a complete pool's last slot).

// In place LayerNorm (eps 1e-6) of each row of k [rows, d]. grid: rows; block 128.
extern "C" __global__ void idx_layer_norm(float* k, int d, const float* w, const float* b) {
    __shared__ float buf[32];
    float* x = k + (size_t)blockIdx.x * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += x[i];
    float mean = block_sum(s, buf) / d;
    float v = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) v += (x[i] - mean) * (x[i] - mean);
    float inv = rsqrtf(block_sum(v, buf) / d + 1e-6f);
    for (int i = threadIdx.x; i < d; i += blockDim.x) x[i] = (x[i] - mean) * inv * w[i] + b[i];
}

// Writes each row's key (and gate logits when gate != null) into the indexer cache at its slot.
// grid: rows; block 128.
extern "C" __global__ void idx_write_rows(const float* key, const float* gate, int d, const int* slots, int width,
                                          float* cache) {
    int t = blockIdx.x;
    float* row = cache + (size_t)slots[t] * width;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        row[i] = key[(size_t)t * d + i];
        if (gate) row[d + i] = gate[(size_t)t * d + i];
    }
}

// Pools completed by this step's rows: a row whose position p ends a pool (p + 1 a multiple of `pool`)
// computes that pool's key, per channel the softmax over the pool's slots of (gate + ape[slot]) weighing
// the slots' keys, and stores it in the gate columns (d .. 2d) of the pool's last slot: once a pool is
// complete its gate logits are not read again, and each pooled key is computed once per sequence.
// Every slot of the pool was written before (this step's rows by idx_write_rows). One thread per
// channel reads that channel of every slot before it overwrites it. grid: rows; block 128; pool <= 16.
extern "C" __global__ void idx_pool_complete(float* cache, int width, int d, int pool, const float* ape,
                                             const int* tables, int max_blocks, int block_size,
                                             const int* seq_of_row, const int* pos) {
    int t = blockIdx.x;
    int last = pos[t];
    if ((last + 1) % pool != 0) return;
    const int* table = tables + (size_t)seq_of_row[t] * max_blocks;
    float* rows[16];
    for (int i = 0; i < pool; ++i) {
        int p = last + 1 - pool + i;
        rows[i] = cache + ((size_t)table[p / block_size] * block_size + p % block_size) * width;
    }
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float lg[16];
        float mx = -INFINITY;
        for (int i = 0; i < pool; ++i) {
            lg[i] = rows[i][d + c] + ape[(size_t)i * d + c];
            mx = fmaxf(mx, lg[i]);
        }
        float sum = 0.f, acc = 0.f;
        for (int i = 0; i < pool; ++i) {
            float e = expf(lg[i] - mx);
            sum += e;
            acc += e * rows[i][c];
        }
        rows[pool - 1][d + c] = acc / sum;
    }
}

// Candidate scores of each query row: score[t][j] = sum_h w[t][h] * relu(scale * q[t][h] . key_j) for
// the row's (pos[t] + 1) / unit candidates (capped at `stride`): candidate j's key is columns
// key_off .. key_off + d of the indexer row of position j * unit + unit - 1 of the row's sequence (per
// position: unit 1, key_off 0; key pools: unit = pool, key_off = d, where idx_pool_complete put it).
// q [rows, heads, d]; w [rows, heads]; scores [rows, stride]. Everything that varies per step is read from
// device memory (positions, tables), so a captured graph replays it at any context length.
// grid: (rows, any); each block strides over the candidates; block 128; d <= 128;
// dynamic shared memory: (heads * d + heads) floats.
#define IDX_MAX_D 128
extern "C" __global__ void idx_scores(const float* q, const float* w, int heads, int d, float scale,
                                      const int* pos, const int* seg_of_row, int unit, const float* cache,
                                      int width, int key_off, const int* tables, int max_blocks,
                                      int block_size, int stride, float* scores) {
    extern __shared__ float sm[];
    int t = blockIdx.x;
    int count = min((pos[t] + 1) / unit, stride);
    if ((int)(blockIdx.y * blockDim.x) >= count) return;  // the whole block: before any barrier
    float* qs = sm;
    float* ws = sm + heads * d;
    for (int i = threadIdx.x; i < heads * d; i += blockDim.x) qs[i] = q[(size_t)t * heads * d + i];
    for (int i = threadIdx.x; i < heads; i += blockDim.x) ws[i] = w[(size_t)t * heads + i];
    __syncthreads();
    const int* table = tables + (size_t)seg_of_row[t] * max_blocks;
    for (int j = blockIdx.y * blockDim.x + threadIdx.x; j < count; j += gridDim.y * blockDim.x) {
        int p = j * unit + unit - 1;
        const float* key = cache + ((size_t)table[p / block_size] * block_size + p % block_size) * width + key_off;
        float kr[IDX_MAX_D];
#pragma unroll
        for (int c = 0; c < IDX_MAX_D; ++c) kr[c] = c < d ? key[c] : 0.f;
        float acc = 0.f;
        for (int h = 0; h < heads; ++h) {
            const float* qh = qs + h * d;
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < IDX_MAX_D; ++c)
                if (c < d) dot += qh[c] * kr[c];
            acc += ws[h] * fmaxf(dot * scale, 0.f);
        }
        scores[(size_t)t * stride + j] = acc;
    }
}

__device__ __forceinline__ unsigned int hy_order_key(float f) {
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Per query row: the k = min(topk, count) best of its count = (pos[t] + 1) / pool candidates (ties to the
// lower index), as positions in ascending order: a candidate j stands for positions j * pool .. j * pool +
// pool - 1; then, for pooled keys (pool > 1), the positions of the row's own incomplete pool,
// count * pool ..= pos[t]. sel [rows, sel_stride], sel_len [rows]. grid: rows; block 256.
extern "C" __global__ void idx_topk(const float* scores, int stride, const int* pos, int topk, int pool, int* sel,
                                    int sel_stride, int* sel_len) {
    __shared__ float fbuf[32];
    __shared__ int ibuf[32];
    int t = blockIdx.x;
    int count = min((pos[t] + 1) / pool, stride);
    int k = min(topk, count);
    const float* sc = scores + (size_t)t * stride;
    int per = (count + blockDim.x - 1) / blockDim.x;
    int lo = threadIdx.x * per, hi = min(count, lo + per);
    // The k-th largest order key, bit by bit from the top: the largest T with count(key >= T) >= k.
    unsigned int thr = 0;
    if (k < count && k > 0) {
        for (int b = 31; b >= 0; --b) {
            unsigned int cand_t = thr | (1u << b);
            int c = 0;
            for (int j = lo; j < hi; ++j) c += hy_order_key(sc[j]) >= cand_t;
            float tot = block_sum((float)c, fbuf);
            if ((int)(tot + 0.5f) >= k) thr = cand_t;
        }
    }
    // Selected: key > thr, plus the first (k - count(key > thr)) ties in index order.
    int gt = 0, ties = 0;
    if (k < count) {
        for (int j = lo; j < hi; ++j) {
            unsigned int key = hy_order_key(sc[j]);
            gt += key > thr;
            ties += key == thr;
        }
    } else {
        gt = hi > lo ? hi - lo : 0;
    }
    int total_gt, total_ties;
    int gt_before = hy_block_scan(gt, ibuf, &total_gt);
    int ties_before = hy_block_scan(ties, ibuf, &total_ties);
    int ties_wanted = k - total_gt;
    int my_ties = max(0, min(ties, ties_wanted - ties_before));
    int taken = gt + my_ties, total_taken;
    int out0 = hy_block_scan(taken, ibuf, &total_taken);
    int* o = sel + (size_t)t * sel_stride;
    int w = out0, tie_seen = ties_before;
    for (int j = lo; j < hi; ++j) {
        bool take;
        if (k < count) {
            unsigned int key = hy_order_key(sc[j]);
            take = key > thr;
            if (key == thr) {
                take = tie_seen < ties_wanted;
                ++tie_seen;
            }
        } else {
            take = true;
        }
        if (take) {
            for (int i = 0; i < pool; ++i) o[(size_t)w * pool + i] = j * pool + i;
            ++w;
        }
    }
    int n = total_taken * pool;
    if (pool > 1) {  // the own, incomplete pool
        int first = count * pool, last = pos[t];
        for (int p = first + threadIdx.x; p <= last; p += blockDim.x) o[n + (p - first)] = p;
        n += max(0, last - first + 1);
    }
    if (threadIdx.x == 0) sel_len[t] = n;
}

// ---------------------------------------------------------------------------------------------------
// MLA (absorbed) attention of each (token, head) over the positions in sel[t][0 .. sel_len[t]] of its
// sequence (the indexer's choice), with an online softmax; otherwise as kernels.cu's mla_attention.
// Per tile of 128 listed positions: each warp scores positions with its lanes across the latent row
// (32 consecutive values per load), then each thread accumulates its latent columns over the tile.
// grid: (tokens, heads); block 128 (a multiple of 32); smem: (nope + rope + 2 * lora + blockDim.x) floats.
extern "C" __global__ void mla_attention_selected(const float* q, const bf16* lat_cache, const bf16* rope_cache,
                                                  const int* block_tables, int max_blocks, const int* seq_of_token,
                                                  const int* sel, int sel_stride, const int* sel_len, int heads,
                                                  int nope, int rope, int lora, int vdim, const float* kv_b,
                                                  int block_size, float scale, bf16* out) {
    extern __shared__ float smem[];
    __shared__ float buf[32];
    __shared__ int slots[128];
    float* qn = smem;
    float* qr = qn + nope;
    float* q_lat = qr + rope;
    float* o_lat = q_lat + lora;
    float* sc = o_lat + lora;
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const float* qh = q + ((size_t)t * heads + h) * (nope + rope);
    for (int i = tid; i < nope + rope; i += blockDim.x) {
        if (i < nope) qn[i] = qh[i];
        else qr[i - nope] = qh[i];
    }
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
    const int* list = sel + (size_t)t * sel_stride;
    int count = sel_len[t];
    float m = -INFINITY, l = 0.f;
    int lane = tid % WARP, wid = tid / WARP, warps = blockDim.x / WARP;
    for (int base = 0; base < count; base += blockDim.x) {
        int n = min((int)blockDim.x, count - base);
        if (tid < n) {
            int p = list[base + tid];
            slots[tid] = table[p / block_size] * block_size + p % block_size;
        }
        __syncthreads();
        // scores: one warp per position, its lanes across the latent row (coalesced reads)
        for (int i = wid; i < n; i += warps) {
            const bf16* lr = lat_cache + (size_t)slots[i] * lora;
            const bf16* rr = rope_cache + (size_t)slots[i] * rope;
            float dot = 0.f;
            for (int c = lane; c < lora; c += WARP) dot += q_lat[c] * bf2f(lr[c]);
            for (int r = lane; r < rope; r += WARP) dot += qr[r] * bf2f(rr[r]);
            dot = warp_sum(dot);
            if (lane == 0) sc[i] = dot * scale;
        }
        __syncthreads();
        float s = tid < n ? sc[tid] : -INFINITY;
        float m_new = fmaxf(m, block_max(s, buf));
        float corr = expf(m - m_new);
        float e = tid < n ? expf(s - m_new) : 0.f;
        sc[tid] = e;  // this thread's own entry, read above
        l = l * corr + block_sum(e, buf);
        for (int c = tid; c < lora; c += blockDim.x) {
            float a = o_lat[c] * corr;
            for (int jj = 0; jj < n; ++jj) a += sc[jj] * bf2f(lat_cache[(size_t)slots[jj] * lora + c]);
            o_lat[c] = a;
        }
        m = m_new;
        __syncthreads();
    }
    // the value projection: one warp per output, its lanes across the weight row
    for (int j = wid; j < vdim; j += warps) {
        const float* wv = wk + (size_t)(nope + j) * lora;
        float a = 0.f;
        for (int c = lane; c < lora; c += WARP) a += wv[c] * o_lat[c];
        a = warp_sum(a);
        if (lane == 0) out[((size_t)t * heads + h) * vdim + j] = f2bf(l > 0.f ? a / l : 0.f);
    }
}
