"""The bytes a rank's collectives move in one step, counted from the real code as it runs.

A dispatch mode sees every c10d operator the step calls (FSDP2's all-gathers, reduce-scatters and
all-reduces, the loss's own all-reduce) with its tensors and its process group, over a fake group as
over a real one. Each is counted as the bytes one rank sends over a ring of the group's `n` ranks:
an all-gather (n - 1) x its input, a reduce-scatter (n - 1)/n x its input, an all-reduce
2 (n - 1)/n x its tensors: NCCL's bus bytes. The plan prices the step's traffic from these counts,
each mesh dimension at its own bus (`simulate_job`). No Ray.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group(args) -> dist.ProcessGroup | None:
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a)
    return None


class CountedTraffic(TorchDispatchMode):
    """Bytes a rank sends, by the name `names` gives each group (its group name otherwise)."""

    def __init__(self, names: dict[str, str] | None = None):
        super().__init__()
        self.names = names or {}
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            group = _group(args)
            if group is not None and group.size() > 1:
                n = group.size()
                op = func.__name__.split(".")[0]
                if op.startswith("_allgather_base") or op.startswith("allgather_into_tensor"):
                    sent = (n - 1) * _nbytes(args[1])
                elif op.startswith("_reduce_scatter_base") or op.startswith("reduce_scatter_tensor"):
                    sent = (n - 1) / n * _nbytes(args[1])
                elif op.startswith("allreduce"):
                    sent = 2 * (n - 1) / n * _nbytes(args[0])
                else:  # a broadcast, a send: its tensors once
                    sent = _nbytes(args[0])
                name = self.names.get(group.group_name, group.group_name)
                self.bytes[name] += sent
                self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    def gigabytes(self) -> dict[str, float]:
        return {k: float(f"{v / 1e9:.4g}") for k, v in sorted(self.bytes.items())}
