// Helpers every NVRTC module of the GPU backend starts with (prepended to `kernels.cu` and its
// siblings, and to `hybrid.cu`): bf16 as raw bits (NVRTC needs no CUDA headers), warp and block
// reductions.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef unsigned short bf16;
__device__ __forceinline__ float bf2f(bf16 b) { return __uint_as_float(((unsigned int)b) << 16); }
// f16 bits -> f32 (PTX conversion: no cuda_fp16.h needed under NVRTC).
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ bf16 f2bf(float f) {  // round to nearest even, NaN kept quiet
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (bf16)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (bf16)(u >> 16);
}

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
// Block-wide sum for blockDim.x <= 1024; `buf` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* buf) {
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    int nw = (blockDim.x + WARP - 1) / WARP;
    v = (threadIdx.x < nw) ? buf[threadIdx.x] : 0.f;
    if (wid == 0) v = warp_sum(v);
    if (threadIdx.x == 0) buf[0] = v;
    __syncthreads();
    return buf[0];
}
__device__ float block_max(float v, float* buf) {
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    int nw = (blockDim.x + WARP - 1) / WARP;
    v = (threadIdx.x < nw) ? buf[threadIdx.x] : -INFINITY;
    if (wid == 0) v = warp_max(v);
    if (threadIdx.x == 0) buf[0] = v;
    __syncthreads();
    return buf[0];
}

