"""kt-kernel's FP8 MoE class (AMXFP8_MOE: E4M3 weights, 128x128 block scales, bf16 activations) on random
weights, timed as `shared/anchors/kt_moe_bench.py` times its bf16 classes, so `bench cpu-moe --dtype fp8` has
its anchor at the same shape. One random source serves every layer (each layer repacks into its own memory,
so every layer still streams from DRAM). Needs the anchor wheel on PYTHONPATH (see kernels/bench/fp8_on_device.sh).
"""
import argparse, time, numpy as np
try:
    from kt_kernel import kt_kernel_ext as k
except Exception:
    import kt_kernel_ext as k

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=128); ap.add_argument("--topk", type=int, default=8)
ap.add_argument("--hidden", type=int, default=2048); ap.add_argument("--inter", type=int, default=768)
ap.add_argument("--threads", type=int, default=12); ap.add_argument("--cls", default="AMXFP8_MOE")
ap.add_argument("--qlens", type=int, nargs="+", default=[1, 4, 16, 64])
ap.add_argument("--iters", type=int, default=20); ap.add_argument("--layers", type=int, default=8)
a = ap.parse_args()
E, K, H, I = a.experts, a.topk, a.hidden, a.inter
wp = k.WorkerPoolConfig(); wp.subpool_count = 1; wp.subpool_numa_map = [0]
wp.subpool_thread_count = [a.threads]
cpu = k.CPUInfer(wp)
rng = np.random.default_rng(0)

def fp8(shape):
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3E                       # no NaN codes
    return b

def scales(e, n, kk):
    return np.full((e, -(-n // 128), -(-kk // 128)), 0.02 / 448, dtype=np.float32)

g, u, d = fp8((E, I, H)), fp8((E, I, H)), fp8((E, H, I))
gs, us, ds = scales(E, I, H), scales(E, I, H), scales(E, H, I)
p2l = np.arange(E, dtype=np.int64)
moes = []
for L in range(a.layers):
    c = k.moe.MOEConfig(E, K, H, I, 0)
    c.layer_idx, c.pool, c.max_len = L, cpu.backend_, max(a.qlens)
    c.quant_config.bits, c.quant_config.group_size, c.quant_config.zero_point = 8, 128, False
    c.gate_proj, c.up_proj, c.down_proj = g.ctypes.data, u.ctypes.data, d.ctypes.data
    c.gate_scale, c.up_scale, c.down_scale = gs.ctypes.data, us.ctypes.data, ds.ctypes.data
    m = getattr(k.moe, a.cls)(c)
    cpu.submit(m.load_weights_task(p2l.ctypes.data)); cpu.sync()
    moes.append(m)
bf16 = lambda s: ((rng.standard_normal(s, dtype=np.float32)).view(np.uint32) >> 16).astype(np.uint16)
for q in a.qlens:
    x = bf16((q, H)); out = np.empty((q, H), np.uint16); ql = np.array([q], np.int32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(q)]).astype(np.int64)
    w = rng.random((q, K), dtype=np.float32)
    def step(L):
        cpu.submit(moes[L].forward_task(ql.ctypes.data, K, ids.ctypes.data, w.ctypes.data,
                                        x.ctypes.data, out.ctypes.data, False))
        cpu.sync()
    for i in range(3): step(i % a.layers)
    t = time.perf_counter()
    for i in range(a.iters): step(i % a.layers)
    dt = (time.perf_counter() - t) / a.iters
    touched = E * (1 - (1 - K / E) ** q)
    gbs = touched * 3 * H * I / dt / 1e9
    print(f"{a.cls} threads={a.threads} qlen={q:4d}: {dt*1e3:8.3f} ms/layer  ~{gbs:6.1f} GB/s weights")
