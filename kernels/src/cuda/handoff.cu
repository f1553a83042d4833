
// ---- Decode hand-off between the GPU and the CPU expert pool through mapped pinned host memory ----
// The GPU writes a layer's routing (and the rows the CPU experts read) straight into host memory and
// raises a flag there that the host polls; the host writes the CPU experts' sum into host memory and
// raises another flag, which the GPU waits for before reading the sum. No copy engine and no event
// is involved, so the hand-off costs a kernel's latency each way instead of a DMA per buffer, and the
// GPU side can be enqueued (or replayed from a graph) before the host has produced its half.
// Flags hold 0 (lowered) or 1 (raised); each side lowers the flag it consumed.

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Clock stamps in mapped host memory (`stamps`, GPU global timer in ns), for the host's profile of
// a layer's round trip: [0] the wait saw the host's flag, [1] its add finished, [2] the publish
// raised its flag. One store each per launch; the host reads them once the next publish landed.
#define STAMP_SEEN 0
#define STAMP_ADDED 1
#define STAMP_PUBLISHED 2

// ids/w ([nk]) and, when x is given, x ([nx]) into the host buffers; then the last block to finish
// stamps the time and raises `flag`. `blocks_done` (device memory, 0 between launches) counts
// finished blocks.
// grid: any, block: 256.
extern "C" __global__ void handoff_publish(const int* ids, const float* w, int nk, const float* x, int nx,
                                           int* ids_h, float* w_h, float* x_h, unsigned int* blocks_done,
                                           volatile int* flag, volatile unsigned long long* stamps) {
    int stride = gridDim.x * blockDim.x;
    int i0 = blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = i0; i < nk; i += stride) {
        ids_h[i] = ids[i];
        w_h[i] = w[i];
    }
    if (x) {
        const float4* x4 = (const float4*)x;
        float4* h4 = (float4*)x_h;
        int n4 = nx / 4;
        for (int i = i0; i < n4; i += stride) h4[i] = x4[i];
        for (int i = 4 * n4 + i0; i < nx; i += stride) x_h[i] = x[i];
    }
    // every thread's host writes are visible system-wide before its block is counted
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int done = atomicAdd(blocks_done, 1u);
        if (done == gridDim.x - 1) {
            *blocks_done = 0;
            // the stamp only feeds the host's profile: it needs no fence of its own before the flag
            // (a second system fence here cost the hand-off a PCIe round trip)
            stamps[STAMP_PUBLISHED] = global_ns();
            *flag = 1;
        }
    }
}

// handoff_wait_add's block and the float4 loads each thread keeps in flight per stride.
#define WAIT_THREADS 1024
#define WAIT_LOADS 4

// Waits until the host raises `flag` (thread 0 of each block polls it), then x[i] += y[i] for i < n
// reading y from host memory, WAIT_LOADS float4 per thread in flight. One block up to n = 4 *
// WAIT_THREADS * WAIT_LOADS (the decode rows of the models here); several (long prompts' rows) stride
// over the rows. One poller per block: eight polling warps in one block were measured slower (the
// reads of one host line queue behind each other, and the kernel ends only when the last returns:
// round trip 11.1 µs against 6.3 on the H200, gpu_segment_bench --handoff). A wait longer than
// `timeout_ns` sets `*timed_out` and adds what y holds (the host turns that into an error: the host
// side of a step failed without raising the flag, and the GPU must not hang). Block 0 stamps when it
// saw the flag, the last block to finish when the add finished. One block lowers the flag as soon as it
// is seen, several once all added (the host raises it again only after the next publish, whose system
// fence orders this store before it); no fence at the end: the next kernel reads nothing of this one's
// host writes. x 16-byte aligned, y page-aligned (mapped).
// grid: 1 to ceil(n / (4 * WAIT_THREADS * WAIT_LOADS)); block: WAIT_THREADS.
extern "C" __global__ void handoff_wait_add(float* x, const float* y, size_t n, volatile int* flag,
                                            volatile int* timed_out, unsigned long long timeout_ns,
                                            unsigned int* blocks_done, volatile unsigned long long* stamps) {
    if (threadIdx.x == 0) {
        unsigned long long t0 = global_ns();
        while (*flag == 0) {
            if (global_ns() - t0 > timeout_ns) {
                *timed_out = 1;
                break;
            }
        }
        if (gridDim.x == 1) *flag = 0;
        if (blockIdx.x == 0) stamps[STAMP_SEEN] = global_ns();
    }
    __syncthreads();
    size_t n4 = n / 4, per_block = (size_t)blockDim.x * WAIT_LOADS, stride = gridDim.x * per_block;
    for (size_t i0 = blockIdx.x * per_block + threadIdx.x; i0 < n4; i0 += stride) {
        float4 yv[WAIT_LOADS];
#pragma unroll
        for (int j = 0; j < WAIT_LOADS; ++j) {
            size_t i = i0 + (size_t)j * blockDim.x;
            // (not cached: the host rewrites y for every layer)
            if (i < n4) yv[j] = __ldcv((const float4*)y + i);
        }
#pragma unroll
        for (int j = 0; j < WAIT_LOADS; ++j) {
            size_t i = i0 + (size_t)j * blockDim.x;
            if (i < n4) {
                float4* xi = (float4*)x + i;
                float4 v = *xi;
                v.x += yv[j].x;
                v.y += yv[j].y;
                v.z += yv[j].z;
                v.w += yv[j].w;
                *xi = v;
            }
        }
    }
    // the tail of n % 4 elements, by the last block
    if (blockIdx.x == gridDim.x - 1)
        for (size_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) x[i] += __ldcv(y + i);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (gridDim.x == 1) {
            stamps[STAMP_ADDED] = global_ns();
        } else if (atomicAdd(blocks_done, 1u) == gridDim.x - 1) {
            *blocks_done = 0;
            *flag = 0;
            stamps[STAMP_ADDED] = global_ns();
        }
    }
}
