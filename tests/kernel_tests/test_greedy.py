"""logits_argmax: float32 logits and torch.argmax's choice (first of ties, first NaN)."""
import pytest
import torch

from infergraft.kernels.greedy import logits_argmax_torch, logits_argmax_triton

from .tolerances import assert_exact

IMPLS = [logits_argmax_torch, logits_argmax_triton]
# (n, V): the decode shape, ragged, tiny, and just over one 4096 chunk
SHAPES = [(1, 32000), (3, 1000), (2, 5), (4, 4097)]


def _rows(randn, n, v, dtype, layout):
    """y: [n, V] with last dim contiguous; 'strided' rows sit inside a wider buffer."""
    if layout == "contiguous":
        return randn(n, v, dtype=dtype)
    return randn(2 * n, v + 5, dtype=dtype)[::2, 3:v + 3]  # row stride 2*(V+5)


def _run(fn, y, fill=-1):
    """Both outputs of ``fn``, ``out`` pre-filled with a value no argmax can take."""
    out = torch.full((y.shape[0],), fill, dtype=torch.int64, device=y.device)
    logits = fn(y, out)
    return logits, out


def _check(y, expect=None):
    """The kernel against y.float() and torch.argmax (and ``expect`` when given)."""
    y0 = y.clone()
    ref = torch.argmax(y.float(), -1)
    # the default chunk, 4096-wide chunks (boundaries), 256-wide ones (many programs a row
    # for the split kernel); each row on one program, or split over programs
    for block, split in ((None, True), (4096, True), (256, True), (None, False), (4096, False)):
        how = f"block {block}, split {split}"
        logits, idx = _run(lambda y, out: logits_argmax_triton(y, out, block=block, split=split), y)
        assert logits.dtype == torch.float32 and logits.shape == y.shape and logits.is_contiguous()
        assert_exact(logits, y.float(), f"logits != y.float() ({how})")
        assert_exact(idx, ref, f"argmax ({how})")
        if expect is not None:
            assert idx.tolist() == expect, how
    ref_logits, ref_idx = _run(logits_argmax_torch, y)
    assert_exact(ref_logits, y.float(), "reference logits")
    assert_exact(ref_idx, ref, "reference argmax")
    assert_exact(y, y0, "y modified")


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n,v", SHAPES)
def test_matches_torch(device, dtype, randn, poisoned_empty, n, v, layout):
    y = _rows(randn, n, v, dtype, layout)
    assert (y.stride(0) > v) == (layout == "strided")
    _check(y)


def test_ties_take_the_first_index(device, dtype, randn, poisoned_empty):
    y = randn(4, 9000, dtype=dtype)
    y[0, 100] = y[0, 8500] = 50.0  # across chunks (4096 wide): the earlier chunk wins
    y[1, 4095] = y[1, 4096] = y[1, 8191] = 50.0  # both sides of a chunk boundary
    y[2, 8500] = y[2, 4196] = 50.0  # same lane (4196 % 4096 == 100) in two later chunks
    y[3] = 1.5  # all equal
    _check(y, expect=[100, 4095, 4196, 0])


def test_ties_in_one_chunk_and_infinities(device, dtype, randn, poisoned_empty):
    y = randn(3, 37, dtype=dtype)
    y[0, 30] = y[0, 9] = y[0, 20] = 7.0  # lanes of one chunk: the smallest column
    y[1] = float("-inf")  # nothing beats -inf: torch says 0
    y[2, 11] = y[2, 3] = float("inf")
    _check(y, expect=[9, 0, 3])


def test_nan_wins_first_nan(device, dtype, randn, poisoned_empty):
    y = randn(4, 9000, dtype=dtype)
    y[0, 7] = y[0, 5000] = float("nan")
    y[1, 3] = float("inf")  # NaN beats +inf in torch.argmax
    y[1, 6000] = float("nan")
    y[2, 8999] = float("nan")  # only in the last (ragged) chunk
    y[3, 4103] = y[3, 7] = float("nan")  # one lane: the first chunk's NaN is kept
    # torch's rule on this version, which the kernel must follow
    expect = torch.argmax(y.float(), -1).tolist()
    assert expect == [7, 6000, 8999, 7], f"torch.argmax NaN rule changed: {expect}"
    variants = {"torch": logits_argmax_torch, "split": logits_argmax_triton,
                "split 256": lambda y, out: logits_argmax_triton(y, out, block=256),
                "one program": lambda y, out: logits_argmax_triton(y, out, split=False)}
    for name, fn in variants.items():
        logits, idx = _run(fn, y)
        assert torch.equal(torch.isnan(logits), torch.isnan(y)), name
        finite = ~torch.isnan(y)
        assert_exact(logits[finite], y.float()[finite], f"{name}: logits != y.float()")
        assert idx.tolist() == expect, name


@pytest.mark.parametrize("fn", IMPLS)
def test_out_slice_only_its_rows_change(device, randn, poisoned_empty, fn):
    y = randn(3, 5000)
    buf = torch.full((10,), -7, dtype=torch.int64, device=device)
    out = buf[4:7]
    logits = fn(y, out)
    assert logits.data_ptr() != y.data_ptr()  # a new tensor even for float32 y
    assert buf[4:7].tolist() == torch.argmax(y, -1).tolist()
    assert buf[:4].tolist() == [-7] * 4 and buf[7:].tolist() == [-7] * 3


@pytest.mark.parametrize("fn", IMPLS)
def test_empty_rows(device, randn, fn):
    buf = torch.full((2,), -7, dtype=torch.int64, device=device)
    logits = fn(randn(0, 64), buf[:0])
    assert logits.shape == (0, 64) and logits.dtype == torch.float32
    assert buf.tolist() == [-7, -7]


@pytest.mark.parametrize("fn", IMPLS)
def test_rejects_bad_inputs(device, randn, fn):
    y = randn(4, 16)
    out = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="2-D"):
        fn(randn(16), out)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        fn(y.to(torch.int32), out)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        fn(y.double(), out)
    with pytest.raises(ValueError, match="int64"):
        fn(y, out.int())
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        fn(y, torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        fn(y, torch.zeros(4, 1, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        fn(y, torch.zeros(8, dtype=torch.int64, device=device)[::2])
    with pytest.raises(ValueError, match="width 0"):
        fn(randn(4, 0), out)
    with pytest.raises(ValueError, match="device"):
        fn(y, torch.zeros(4, dtype=torch.int64, device="meta"))


def test_triton_rejects_strided_columns(device, randn):
    out = torch.zeros(16, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        logits_argmax_triton(randn(8, 16).t(), out)


def test_split_rows_count_on_the_callers_pool(device, randn, poisoned_empty, shared_counters):
    # each engine's model owns its counters: the split kernel draws on the pool it is given
    from infergraft.kernels import paged_plan

    shared = shared_counters
    y = randn(3, 5000)
    mine = paged_plan.CounterPool()
    _, idx = _run(lambda y, out: logits_argmax_triton(y, out, split=True, block=1024,
                                                      counters=mine), y)
    assert idx.tolist() == torch.argmax(y, -1).tolist()
    (buf,) = mine._buffers.values()
    assert (buf == 0).all() and not shared._buffers
    _, idx = _run(lambda y, out: logits_argmax_triton(y, out, split=True, block=1024), y)
    assert idx.tolist() == torch.argmax(y, -1).tolist() and len(shared._buffers) == 1
