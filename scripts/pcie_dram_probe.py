#!/usr/bin/env python3
# Usage on the GPU machine: python3 scripts/pcie_dram_probe.py  (torch with CUDA; ~10 s)
# Does a PCIe DMA from pinned host memory add DRAM read bandwidth on top of 16 CPU threads reading DRAM,
# or take it from them? Times: CPU read alone, H2D copies alone, both at once (copies on a CUDA stream
# issued asynchronously, the CPU reads in the meantime). Decides whether a decode step's DRAM experts
# should be split between the CPU kernels and the GPU (through PCIe) at batch 1.
import time, threading, torch
torch.set_num_threads(16)
GB = 1e9
cpu_buf = torch.ones(4 << 30 >> 2, dtype=torch.float32)            # 4 GiB, not pinned: the CPU side's data
host = [torch.empty(256 << 20, dtype=torch.uint8).pin_memory() for _ in range(8)]  # 2 GiB pinned sources
dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
s = torch.cuda.Stream()

def cpu_read(rounds):
    t = time.perf_counter()
    for _ in range(rounds):
        cpu_buf.sum()
    return rounds * cpu_buf.numel() * 4 / (time.perf_counter() - t) / GB

def dma(n):
    with torch.cuda.stream(s):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(s)
        for i in range(n):
            dev.copy_(host[i % 8], non_blocking=True)
        b.record(s)
    return a, b

cpu_read(2)
alone_cpu = [cpu_read(6) for _ in range(3)]
a, b = dma(64); b.synchronize(); alone_dma = 64 * (256 << 20) / (a.elapsed_time(b) / 1e3) / GB
for rep in range(3):
    a, b = dma(160)                       # ~0.8 s of copies at 55 GB/s; the CPU reads until they end
    t, n = time.perf_counter(), 0
    while not b.query():
        cpu_buf.sum(); n += 1
    both_cpu = n * cpu_buf.numel() * 4 / (time.perf_counter() - t) / GB
    busy = n
    b.synchronize(); both_dma = 160 * (256 << 20) / (a.elapsed_time(b) / 1e3) / GB
    print(f"[dma] round {rep}: CPU alone {alone_cpu[rep]:.1f} GB/s, DMA alone {alone_dma:.1f}; together CPU {both_cpu:.1f} "
          f"+ DMA {both_dma:.1f} = {both_cpu + both_dma:.1f} GB/s ({busy} CPU rounds)")
