"""Row strides of the receive buffer: 1040 (16 B aligned), 1056 (32), 1088 (64), 1152 (128), 1024 B."""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_copy import regs1, plain, bench, W
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
rows = 512 * 48 * 8
src = torch.randint(-2**31, 2**31 - 1, (rows, W), dtype=torch.int32, device=dev)
nbytes = 2 * src.numel() * 4
big = torch.empty_like(src)
ref = nbytes / bench(lambda: big.copy_(src)) / 1e12
print(f"{torch.cuda.get_device_name()} copy_ {ref:.2f} TB/s")
for stride in (260, 264, 272, 288, 256):
    dst = torch.empty((rows, stride), dtype=torch.int32, device=dev)
    for R in (16, 32):
        n = rows // R
        for name, fn in (("regs1", lambda: regs1[(sms,)](src, dst, n, stride, R, num_warps=16)),
                         ("plain", lambda: plain[(n,)](src, dst, stride, R, num_warps=16))):
            dst.fill_(-1); fn(); torch.cuda.synchronize()
            ok = torch.equal(dst[:, :W], src)
            # the read side: rows of this stride back into a dense buffer
            rate = nbytes / bench(fn) / 1e12
            print(f"{name} R={R} stride={stride * 4}: {rate:.2f} TB/s {100 * rate / ref:.0f}%" + ("" if ok else " WRONG"))
    # reading rows of this stride (the combine's side): a strided copy into a dense buffer
    rate = nbytes / bench(lambda: big.copy_(dst[:, :W])) / 1e12
    print(f"read  torch strided copy_ stride={stride * 4}: {rate:.2f} TB/s {100 * rate / ref:.0f}%")
    del dst
