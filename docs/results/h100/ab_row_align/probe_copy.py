"""What limits a large combine's copies: one process, the whole GPU, rows of 1 KiB (512 bf16) copied
from a dense source to a destination with the receive buffer's row stride, as the push does.

Variants (bytes read plus written over the median time of 20 runs, against torch's copy_):
  regs1  persistent grid (one 16-warp program per SM), a tile [R, 512] bf16 loaded one ahead (the push)
  regs2  the same, two tiles ahead
  plain  one program per tile (no persistent loop)
  tma<S> persistent, TMA loads (tensor descriptors) pipelined over S stages, TMA stores
each at R = 16 and 32 rows a tile, destination row stride 1040 B (the receive rows: D + LSE lanes,
padded to 16 B) and 1024 B (rows without their LSEs).
"""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

W = 256  # int32 words per 1 KiB row


@triton.jit
def regs1(src, dst, n_tiles, DST_STRIDE: tl.constexpr, R: tl.constexpr):
    pid, G = tl.program_id(0), tl.num_programs(0)
    r, c = tl.arange(0, R)[:, None], tl.arange(0, 256)[None, :]
    t = pid
    v = tl.load(src + (t * R + r).to(tl.int64) * 256 + c, mask=(t < n_tiles) & (c >= 0))
    while t < n_tiles:
        nv = tl.load(src + ((t + G) * R + r).to(tl.int64) * 256 + c, mask=(t + G < n_tiles) & (c >= 0))
        tl.store(dst + (t * R + r).to(tl.int64) * DST_STRIDE + c, v)
        v = nv
        t += G


@triton.jit
def regs2(src, dst, n_tiles, DST_STRIDE: tl.constexpr, R: tl.constexpr):
    pid, G = tl.program_id(0), tl.num_programs(0)
    r, c = tl.arange(0, R)[:, None], tl.arange(0, 256)[None, :]
    t = pid
    v = tl.load(src + (t * R + r).to(tl.int64) * 256 + c, mask=(t < n_tiles) & (c >= 0))
    v2 = tl.load(src + ((t + G) * R + r).to(tl.int64) * 256 + c, mask=(t + G < n_tiles) & (c >= 0))
    while t < n_tiles:
        nv = tl.load(src + ((t + 2 * G) * R + r).to(tl.int64) * 256 + c, mask=(t + 2 * G < n_tiles) & (c >= 0))
        tl.store(dst + (t * R + r).to(tl.int64) * DST_STRIDE + c, v)
        v = v2
        v2 = nv
        t += G


@triton.jit
def plain(src, dst, DST_STRIDE: tl.constexpr, R: tl.constexpr):
    t = tl.program_id(0)
    r, c = tl.arange(0, R)[:, None], tl.arange(0, 256)[None, :]
    tl.store(dst + (t * R + r).to(tl.int64) * DST_STRIDE + c, tl.load(src + (t * R + r).to(tl.int64) * 256 + c))


@triton.jit
def tma(src_desc, dst_desc, n_tiles, R: tl.constexpr, STAGES: tl.constexpr):
    pid, G = tl.program_id(0), tl.num_programs(0)
    for t in tl.range(pid, n_tiles, G, num_stages=STAGES):
        dst_desc.store([t * R, 0], src_desc.load([t * R, 0]))


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def main():
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = 512 * 48 * 8  # 196,608 rows: 201 MB read, several times the L2
    src = torch.randint(-2**31, 2**31 - 1, (rows, W), dtype=torch.int32, device=dev)
    nbytes = 2 * src.numel() * 4
    out = {}
    big = torch.empty_like(src)
    t = bench(lambda: big.copy_(src))
    out["torch copy_"] = nbytes / t / 1e12
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'variant':24} {'TB/s':>6} {'of copy_':>8}")
    print(f"{'torch copy_':24} {out['torch copy_']:6.2f}")
    for stride in (260, 256):
        dst = torch.empty((rows, stride), dtype=torch.int32, device=dev)
        for R in (16, 32, 64):
            n_tiles = rows // R
            runs = {
                "regs1": lambda: regs1[(sms,)](src, dst, n_tiles, stride, R, num_warps=16),
                "regs2": lambda: regs2[(sms,)](src, dst, n_tiles, stride, R, num_warps=16),
                "plain": lambda: plain[(n_tiles,)](src, dst, stride, R, num_warps=16),
            }
            for stages in (2, 3, 4):
                sd = TensorDescriptor.from_tensor(src, [R, W])
                dd = TensorDescriptor(dst, [rows, W], [stride, 1], [R, W])
                runs[f"tma{stages}"] = (lambda sd=sd, dd=dd, stages=stages:
                                        tma[(sms,)](sd, dd, n_tiles, R, stages, num_warps=8))
            for name, fn in runs.items():
                label = f"{name} R={R} stride={stride * 4}"
                try:
                    dst.fill_(-1)
                    fn()
                    torch.cuda.synchronize()
                    ok = torch.equal(dst[:, :W], src)
                    t = bench(fn)
                    rate = nbytes / t / 1e12
                    out[label] = rate
                    print(f"{label:24} {rate:6.2f} {100 * rate / out['torch copy_']:7.0f}%" + ("" if ok else "  WRONG"))
                except Exception as exc:  # a variant that does not build here is reported, not fatal
                    print(f"{label:24} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                sys.stdout.flush()
        del dst


if __name__ == "__main__":
    main()
