"""A batch's features from a target actor to its drafter actor: Ray's object store (the return value
serialized, stored, read back) against torch.distributed send/recv (`train.handoff`, gloo on the
CPU), side by side in one run, alternating.

The batch is the Qwen3.6-27B preset's per-sample features by default: 4,096 tokens × 5 captured
layers × 5,120 hidden in bf16 (210 MB), with its input_ids and loss_mask. Each case times the
handoff from the moment the target starts handing the batch over until the drafter holds it as
tensors; the target makes a fresh batch each time (as a forward does), outside the timing.
Printed: bytes through Ray per step for each path, and the ratio of the medians.

    .venv/bin/python -m bench.handoff [--tokens 4096] [--hidden 25600] [--iters 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import torch


def _batch(tokens: int, hidden: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 1000, (1, tokens)),
        "loss_mask": torch.ones(1, tokens, dtype=torch.long),
        "features": torch.randn(1, tokens, hidden, dtype=torch.bfloat16),
    }


class Target:
    def __init__(self, tokens: int, hidden: int):
        self.shape, self.sent = (tokens, hidden), []

    def join(self, port: int) -> None:
        from dflash_ray.train import handoff

        handoff.join("gloo", "127.0.0.1", port, 0, handoff.Layout(1, 1), 600)
        handoff.greet([1], True, "cpu")

    def stored(self) -> tuple[float, dict]:
        """A fresh batch, returned through the object store: its serialization starts now."""
        batch = _batch(*self.shape)
        return time.time(), batch

    def direct(self) -> tuple[float, dict]:
        from dflash_ray.train import handoff

        batch = _batch(*self.shape)
        start = time.time()
        self.sent = [s for s in self.sent if not s.done()]
        self.sent.append(handoff.send(batch, [1]))
        return start, {"meta": self.sent[-1].meta}


class Drafter:
    def join(self, port: int) -> None:
        from dflash_ray.train import handoff

        handoff.join("gloo", "127.0.0.1", port, 1, handoff.Layout(1, 1), 600)
        handoff.greet([0], False, "cpu")

    def take(self, handed: tuple[float, dict]) -> float:
        """Seconds from the start of the handoff until this actor holds the batch."""
        from dflash_ray.train import handoff

        start, batch = handed
        if "meta" in batch:
            batch = handoff.receive(batch["meta"], 0, "cpu")
        assert batch["features"].dtype == torch.bfloat16
        return time.time() - start


def _handoffs(args) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each path's handoff seconds (the warm-up round left out) and its bytes through Ray, between a
    target and a drafter actor of one CPU each."""
    import ray

    from dflash_ray.train.streams import free_port

    target = ray.remote(Target).options(num_cpus=1).remote(args.tokens, args.hidden)
    drafter = ray.remote(Drafter).options(num_cpus=1).remote()
    port = free_port()
    ray.get([target.join.remote(port), drafter.join.remote(port)])
    seconds: dict[str, list[float]] = {"object_store": [], "direct": []}
    through_ray = {}
    for i in range(args.iters + 1):  # the first round warms both paths up and is not counted
        for path, call in (("object_store", target.stored), ("direct", target.direct)):
            handed = call.remote()
            taken = ray.get(drafter.take.remote(handed))
            if i:
                seconds[path].append(taken)
            through_ray[path] = len(pickle.dumps(ray.get(handed)))
    for actor in (target, drafter):  # their process group with them, before another run's
        ray.kill(actor)
    return seconds, through_ray


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=5 * 5120, help="captured layers × hidden size")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from bench.local_ray import local_ray

    with local_ray(num_cpus=2, object_store_memory=2 * 1024**3):
        seconds, through_ray = _handoffs(args)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    mb = 2 * args.tokens * args.hidden / 1e6
    row = {
        "bench": "handoff",
        "case": f"{args.tokens}tok_x_{args.hidden}_bf16_{mb:.0f}MB",
        "object_store_s": round(median["object_store"], 4),
        "direct_s": round(median["direct"], 4),
        "object_store_over_direct": round(median["object_store"] / median["direct"], 2),
        "bytes_through_ray_object_store": through_ray["object_store"],
        "bytes_through_ray_direct": through_ray["direct"],
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
