"""The read-ceiling benchmark's kernel (core/tools/kernel_bench/read.py) reads every element it is
timed on: its per-program sums equal torch's on fresh random inputs."""
import torch

from infergraft.core.tools.kernel_bench.read import _read_kernel


def test_read_kernel_sums_every_block_it_streams(device, randn):
    block, iters, progs = 64, 3, 5
    x = randn(progs * iters * block, dtype=torch.float16)
    out = torch.empty(progs, device=device)
    _read_kernel[(progs,)](x, out, BLOCK=block, ITERS=iters)
    torch.testing.assert_close(out, x.float().view(progs, -1).sum(1), rtol=1e-4, atol=1e-3)
