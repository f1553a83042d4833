
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
            stamps[STAMP_PUBLISHED] = global_ns();
            __threadfence_system();
            *flag = 1;
        }
    }
}

// Waits until the host raises `flag` (each block's first thread polls it), then x[i] += y[i] for
// i < n reading y from host memory; the last block to finish lowers the flag. A wait longer than
// `timeout_ns` sets `*timed_out` and adds what y holds (the host turns that into an error: the
// host side of a step failed without raising the flag, and the GPU must not hang). Block 0 stamps
// when it saw the flag, the last block when the add finished.
// grid: any, block: 256.
extern "C" __global__ void handoff_wait_add(float* x, const volatile float* y, size_t n, volatile int* flag,
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
        if (blockIdx.x == 0) stamps[STAMP_SEEN] = global_ns();
    }
    __syncthreads();
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) x[i] += y[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int done = atomicAdd(blocks_done, 1u);
        if (done == gridDim.x - 1) {
            *blocks_done = 0;
            *flag = 0;
            stamps[STAMP_ADDED] = global_ns();
            __threadfence_system();
        }
    }
}
