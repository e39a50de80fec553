"""Triton row kernel for the fused CE: loss, top-1 hit and d loss / d logits, in place.

The chunk's logits come from a regular matmul (cuBLAS on GPU); this kernel then walks each row
once for the online max / sum-exp / argmax and once more to overwrite the logits with their
gradient, so the chunk needs no temporaries beyond the logits themselves. Tested on CPU with
`TRITON_INTERPRET=1` against the PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    stride,
    labels_ptr,
    weights_ptr,
    scale,
    loss_ptr,
    hit_ptr,
    V,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    w = tl.load(weights_ptr + row).to(tl.float32)
    m = float("-inf")
    s = 0.0
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_arg = tl.argmax(x, axis=0) + start
        if block_max > best:
            best = block_max
            best_idx = block_arg
        new_m = tl.maximum(m, block_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(s)
    target = tl.load(base + label).to(tl.float32)
    tl.store(loss_ptr + row, (lse - target) * w)
    tl.store(hit_ptr + row, (best_idx == label).to(tl.int8))
    if WRITE_GRAD:
        g = w * scale
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - (offs == label).to(tl.float32)) * g
            tl.store(base + offs, grad, mask=offs < V)


def ce_rows(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, scale: float, write_grad: bool, block: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row weighted CE and top-1 hits of fp32 `logits` [c, V]; with `write_grad`, `logits`
    is overwritten by (softmax - onehot) * w * scale."""
    c, V = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    hit = torch.empty(c, dtype=torch.int8, device=logits.device)
    _ce_rows_kernel[(c,)](
        logits,
        logits.stride(0),
        labels,
        weights.float().contiguous(),
        scale,
        loss,
        hit,
        V,
        WRITE_GRAD=write_grad,
        BLOCK=min(block, triton.next_power_of_2(V)),
    )
    return loss, hit.bool()
