"""apply_token_bitmask: the Triton kernel against its torch reference and against a plain
per-token loop (the bitmask's meaning), on random masks and odd shapes."""
import pytest
import torch

from infergraft.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton

from .tolerances import assert_exact

IMPLS = [apply_token_bitmask_torch, apply_token_bitmask_triton]
# (B, V, R, W): a decode batch, a vocab not a multiple of 32, a mask narrower than the
# logits (a padded vocabulary), a mask wider than them, one row of one token
SHAPES = [(8, 1000, 3, 32), (5, 97, 5, 4), (4, 200, 2, 5), (3, 40, 1, 4), (1, 1, 1, 1)]


def _meaning(logits, bitmask, rows):
    """The bitmask applied token by token, as its definition reads."""
    out = logits.clone()
    for r, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[row, t] = float("-inf")
    return out


def _random(gen, b, v, r, w, dtype, device):
    logits = torch.randn(b, v, generator=gen).to(device=device, dtype=dtype)
    words = torch.randint(-2 ** 31, 2 ** 31, (r, w), generator=gen, dtype=torch.int64)
    bitmask = words.to(torch.int32).to(device)  # every bit pattern, the sign bit included
    rows = torch.randperm(b, generator=gen)[:r].to(device)
    return logits, bitmask, rows


@pytest.mark.parametrize("b,v,r,w", SHAPES)
def test_matches_the_reference_and_the_meaning(device, dtype, gen, b, v, r, w):
    logits, bitmask, rows = _random(gen, b, v, r, w, dtype, device)
    want = _meaning(logits.cpu(), bitmask.cpu(), rows.cpu())
    ref = apply_token_bitmask_torch(logits.clone(), bitmask, rows)
    assert_exact(ref.cpu(), want, "reference")
    for block in (32, 64, 1024):  # program boundaries inside and past the vocabulary
        got = apply_token_bitmask_triton(logits.clone(), bitmask, rows, block=block)
        assert_exact(got.cpu(), want, f"triton, block {block}")


@pytest.mark.parametrize("fn", IMPLS)
def test_in_place_and_other_rows_untouched(device, gen, fn):
    logits, bitmask, rows = _random(gen, 6, 300, 2, 10, torch.float32, device)
    before = logits.clone()
    out = fn(logits, bitmask, rows)
    assert out.data_ptr() == logits.data_ptr()
    others = [i for i in range(6) if i not in rows.tolist()]
    assert_exact(logits[others], before[others], "unconstrained rows")
    allowed = torch.isfinite(logits[rows])
    assert allowed.any() and not allowed.all()  # random words: some of each


@pytest.mark.parametrize("fn", IMPLS)
def test_all_ones_keeps_a_row_and_zeros_clear_it(device, gen, fn):
    logits = torch.randn(2, 70, generator=gen).to(device)
    before = logits.clone()
    bitmask = torch.tensor([[-1, -1, -1], [0, 0, 0]], dtype=torch.int32, device=device)
    fn(logits, bitmask, torch.tensor([0, 1], device=device))
    assert_exact(logits[0], before[0], "all ones")
    assert torch.isneginf(logits[1]).all()


@pytest.mark.parametrize("fn", IMPLS)
def test_no_rows_is_a_no_op(device, gen, fn):
    logits = torch.randn(3, 50, generator=gen).to(device)
    before = logits.clone()
    fn(logits, torch.zeros(0, 2, dtype=torch.int32, device=device),
       torch.zeros(0, dtype=torch.long, device=device))
    assert_exact(logits, before)


@pytest.mark.parametrize("fn", IMPLS)
def test_rejects_bad_inputs(device, fn):
    logits = torch.zeros(4, 64, device=device)
    mask = torch.zeros(2, 2, dtype=torch.int32, device=device)
    rows = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="2-D"):
        fn(logits[0], mask, rows)
    with pytest.raises(ValueError, match="float32"):
        fn(logits.long(), mask, rows)
    with pytest.raises(ValueError, match="int32"):
        fn(logits, mask.long(), rows)
    with pytest.raises(ValueError, match="contiguous"):
        fn(logits, torch.zeros(2, 4, dtype=torch.int32, device=device)[:, ::2], rows)
    with pytest.raises(ValueError, match="one entry per bitmask row"):
        fn(logits, mask, rows[:1])
    with pytest.raises(ValueError, match="int64"):
        fn(logits, mask, rows.int())
    with pytest.raises(ValueError, match="named once"):
        fn(logits[:1], mask, rows)
    with pytest.raises(ValueError, match="share a device"):
        fn(logits, mask, rows.to("meta"))
