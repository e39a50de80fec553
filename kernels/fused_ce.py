"""Fused linear + weighted cross-entropy (+ top-1 hits) that never holds the full logits.

The LM head over the vocabulary is the memory wall of DFlash training: 512 anchors x 15 positions
x 248,320 entries is 7.6 GB of fp32 logits per sequence before gradients. This path walks the rows
in chunks of about `max_chunk_bytes` of logits, computes loss, top-1 hits and the gradients in the
same pass (the loss is a scalar, so d loss / d logits is known in the forward), and keeps only
[N, H] (and [V, H] when the head is trainable) for the backward. Rows of weight 0 are skipped.

On CUDA the per-row softmax / loss / gradient runs in a Triton kernel (`ce_triton`) that writes
the gradient over the logits in place; elsewhere it runs as PyTorch ops. Both are exact against
`dflash_ray.drafter.loss.naive_loss` (the reference) in loss and gradients.
"""

from __future__ import annotations

import os

import torch


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"

DEFAULT_CHUNK_BYTES = 256 * 1024**2


class _FusedLinearWeightedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, head_VH, labels_N, weights_N, max_chunk_bytes: int):
        N, V = hidden_NH.shape[0], head_VH.shape[0]
        wsum = weights_N.float().sum().clamp_min(1e-12)
        rows = (weights_N > 0).nonzero().flatten()
        chunk = max(1, max_chunk_bytes // (4 * V))
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden_NH.shape, dtype=torch.float32, device=hidden_NH.device) if need_h else None
        grad_w = torch.zeros(head_VH.shape, dtype=torch.float32, device=head_VH.device) if need_w else None
        correct = torch.zeros(N, dtype=torch.bool, device=hidden_NH.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden_NH.device)
        for start in range(0, rows.numel(), chunk):
            idx = rows[start:start + chunk]
            h = hidden_NH[idx]
            y = labels_N[idx]
            w = weights_N[idx].float()
            logits = (h.to(head_VH.dtype) @ head_VH.t()).float()  # [c, V], the only big buffer
            if _use_triton(logits):
                from dflash_ray.kernels.ce_triton import ce_rows

                row_loss, hit = ce_rows(logits, y, w, float(1.0 / wsum), need_h or need_w)
                total += row_loss.sum()
                correct[idx] = hit
                probs = logits  # now holds d loss / d logits
            else:
                lse = torch.logsumexp(logits, dim=-1)
                total += ((lse - logits.gather(1, y[:, None])[:, 0]) * w).sum()
                correct[idx] = logits.argmax(-1) == y
                if need_h or need_w:
                    # d loss / d logits = (softmax - onehot) * w / sum(w), computed in place
                    probs = logits.sub_(lse[:, None]).exp_()
                    probs[torch.arange(idx.numel(), device=probs.device), y] -= 1.0
                    probs.mul_((w / wsum)[:, None])
            if need_h or need_w:
                if need_h:
                    grad_h[idx] = (probs.to(head_VH.dtype) @ head_VH).float()
                if need_w:
                    grad_w += (probs.t().to(h.dtype) @ h).float()
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.has = (need_h, need_w)
        ctx.dtypes = (hidden_NH.dtype, head_VH.dtype)
        ctx.mark_non_differentiable(correct)
        return total / wsum, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        grad_h = (saved.pop(0) * grad_loss).to(ctx.dtypes[0]) if need_h else None
        grad_w = (saved.pop(0) * grad_loss).to(ctx.dtypes[1]) if need_w else None
        return grad_h, grad_w, None, None, None


def fused_linear_weighted_ce(hidden_NH: torch.Tensor, head_VH: torch.Tensor, labels_N: torch.Tensor,
                             weights_N: torch.Tensor, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * CE(hidden @ head.T, labels)) / sum(w), and top-1 hits [N] (False where w = 0)."""
    return _FusedLinearWeightedCE.apply(hidden_NH, head_VH, labels_N, weights_N, max_chunk_bytes)
