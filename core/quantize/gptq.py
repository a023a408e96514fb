"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", 2022) for one linear layer: 4-bit codes in contiguous groups,
asymmetric, no act-order.

The layer's inputs X [n, K] give H = 2 X^T X / n (``Hessian``). Columns are quantised in
order; the error of each is spread over the columns not yet quantised through the upper
Cholesky factor U of H^-1 (row i of U scaled by 1 / U[i, i]), which minimises
||X W^T - X Q^T|| column by column. Columns go in lazy blocks of 128: inside a block
every update is applied at once to the block, the rest of the matrix gets the block's
errors in one GEMM at its end. A group's grid (scale, zero-point: ``pack.int4_grid``) is
taken from its columns' current weights, error updates included, when its first column
comes; group sizes divide the block, so a group never straddles two blocks.

``act_order=True`` (GPTQ's "act-order" with AutoGPTQ's "static groups"): every group's grid
is taken first, from the weights before any update, then the columns go in descending
order of H's diagonal (the inputs with the most energy first, while the most columns are
left to take their error), each on its own group's grid. Groups stay the contiguous ranges
of input columns they were (``g_idx`` = arange(K) // group_size), so the checkpoint loads
as any other; only the order of the work changes.
"""
from __future__ import annotations

import torch

from .pack import int4_grid, round_to_grid

BLOCK = 128  # columns per lazy batch
DAMP = 0.01  # dampening: this fraction of mean(diag(H)) added to the diagonal


class Hessian:
    """H = 2 X^T X / n of a layer's inputs, accumulated batch by batch (each batch's
    product in float32, the sum in float64)."""

    def __init__(self, columns: int):
        self.sum = torch.zeros(columns, columns, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [rows, K]
        self.sum += (x.t() @ x).double()
        self.rows += x.shape[0]

    def value(self) -> torch.Tensor:
        """float64 [K, K]."""
        if not self.rows:
            raise ValueError("no inputs were added to the Hessian")
        return 2 * self.sum / self.rows


def inverse_cholesky(h: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp * mean(diag H) I)^-1, float64 [K, K]. ``h``
    must have no zero diagonal (``gptq_quantize`` sets dead columns' to 1). Where the
    dampened H is not positive definite (rounding, a rank-deficient H) the dampening grows
    tenfold, up to twice."""
    mean_diag = h.diagonal().mean()
    for attempt in range(3):
        damped = h.clone()
        damped.diagonal().add_(damp * 10 ** attempt * mean_diag)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    raise ValueError(f"the Hessian is not positive definite even dampened by "
                     f"{damp * 100:g} % x 100 of its mean diagonal")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int,
                  min_zero: int = 0, damp: float = DAMP, act_order: bool = False):
    """weight [N, K], H [K, K] -> (q uint8 [N, K], zeros uint8 [N, G], scales float16
    [N, G]) as ``pack.rtn_int4`` returns them, but with GPTQ's error compensation.
    ``min_zero`` as in ``pack.int4_grid``; ``act_order``: static groups, columns by
    descending diag(H) (the module's docstring)."""
    assert BLOCK % group_size == 0, f"group_size {group_size} must divide {BLOCK}"
    w = weight.detach().float().clone()  # [N, K], updated as columns are quantised
    n, k = w.shape
    h = hessian.detach().double().clone()
    assert h.shape == (k, k), f"H is {tuple(h.shape)}, the weight has {k} columns"
    # 1) Dead columns (an input that is always 0): any weight gives the same output; 0
    # keeps them out of their group's range.
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    groups = -(-k // group_size)
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups)
    order = torch.arange(k)  # the column quantised i-th
    if act_order:
        # 2) Static groups: every grid from the weights as they are (a partial last group
        # padded with zeros, which its grid holds anyway); then the columns reordered.
        padded = torch.nn.functional.pad(w, (0, groups * group_size - k))
        scales[:], zeros[:] = int4_grid(padded.reshape(n, groups, group_size), min_zero)
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
    group_of = (order // group_size).tolist()
    u = inverse_cholesky(h, damp).float()  # [K, K] upper
    q = torch.empty(n, k, dtype=torch.uint8)
    # 3) Lazy blocks of columns.
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        block = w[:, b0:b1].clone()  # [N, B]
        errors = torch.empty_like(block)
        ub = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = group_of[col]
            if not act_order and col % group_size == 0:
                scales[:, g], zeros[:, g] = int4_grid(block[:, i:i + group_size], min_zero)
            scale, zero = scales[:, g], zeros[:, g]  # [N] each
            codes = round_to_grid(block[:, i], scale, zero)  # [N]
            q[:, col] = codes.to(torch.uint8)
            err = (block[:, i] - (codes - zero) * scale) / ub[i, i]
            # the block's later columns (and this one, which is done) take the error
            block[:, i:].addr_(err, ub[i, i:], alpha=-1)
            errors[:, i] = err
        # 4) The rest of the matrix takes the block's errors at once.
        w[:, b1:].addmm_(errors, u[b0:b1, b1:], alpha=-1)
    if act_order:
        q = q[:, torch.argsort(order)]  # back to the input columns' order
    return q, zeros.to(torch.uint8), scales.half()
