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
    def forward(
        ctx, hidden_NH, head_VH, labels_N, weights_N, max_chunk_bytes: int, soft_ids_Nm=None, soft_probs_Nm=None
    ):
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
            idx = rows[start : start + chunk]
            h = hidden_NH[idx]
            y = labels_N[idx]
            w = weights_N[idx].float()
            logits = (h.to(head_VH.dtype) @ head_VH.t()).float()  # [c, V], the only big buffer
            # soft targets t (rows sum to 1): loss lse - sum_j t_j z_j, gradient softmax - t
            soft = soft_ids_Nm is not None
            if soft:  # read before the logits turn into their gradient
                sid, sp = soft_ids_Nm[idx], soft_probs_Nm[idx].float()
                z_soft = (logits.gather(1, sid) * sp).sum(-1)
            if _use_triton(logits):
                from dflash_ray.kernels.ce_triton import ce_rows

                z_y = logits.gather(1, y[:, None])[:, 0] if soft else None
                row_loss, hit = ce_rows(logits, y, w, float(1.0 / wsum), need_h or need_w)
                total += row_loss.sum()
                correct[idx] = hit
                probs = logits  # now holds d loss / d logits
                if soft:  # the kernel's loss and gradient are against y: move them to t
                    total += ((z_y - z_soft) * w).sum()
                    if need_h or need_w:
                        g = (w / wsum)[:, None]
                        probs.scatter_add_(1, y[:, None], g)
                        probs.scatter_add_(1, sid, -sp * g)
            else:
                lse = torch.logsumexp(logits, dim=-1)
                target = z_soft if soft else logits.gather(1, y[:, None])[:, 0]
                total += ((lse - target) * w).sum()
                correct[idx] = logits.argmax(-1) == y
                if need_h or need_w:
                    # d loss / d logits = (softmax - t) * w / sum(w), computed in place
                    probs = logits.sub_(lse[:, None]).exp_()
                    if soft:
                        probs.scatter_add_(1, sid, -sp)
                    else:
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
        return grad_h, grad_w, None, None, None, None, None


def fused_linear_weighted_ce(
    hidden_NH: torch.Tensor,
    head_VH: torch.Tensor,
    labels_N: torch.Tensor,
    weights_N: torch.Tensor,
    soft_ids_Nm: torch.Tensor | None = None,
    soft_probs_Nm: torch.Tensor | None = None,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * CE(hidden @ head.T, labels)) / sum(w), and top-1 hits [N] (False where w = 0).
    With soft targets (ids and probabilities [N, m], rows summing to 1) the CE is against them."""
    return _FusedLinearWeightedCE.apply(
        hidden_NH, head_VH, labels_N, weights_N, max_chunk_bytes, soft_ids_Nm, soft_probs_Nm
    )
