"""What the demo's training step and decoding step cost, each change against what it replaced,
side by side in one process on SmolLM2-135M-Instruct's shapes (hidden 576, vocabulary 49,152):

- DSpark's loss over one chunk (32 anchors x block 7 = 224 rows), forward and backward, with its
  logits recomputed in backward (the checkpoint) against kept;
- a target batch's outputs computed by the forward against served from the feature cache
  (`train.feature_cache_gb`), on a demo-length sample;
- a drafter's whole training step (the demo's drafter) in fp32 against bf16 matmuls over fp32
  master weights (`train.dtype`), where the CPU has native bf16 (AVX512-BF16, AMX);
- a decoding step's head product for a block of 7 rows, hidden @ head^T against head @ hidden^T;
- the demo's drafter step with hard labels alone (DSpark's tv_weight 0): the target's distribution
  computed for the confidence label against skipped (the confidence labelled with the hits);
- the target's side of that step: its last hidden states computed and sent (the whole forward)
  against the features alone (the forward stops after the deepest captured layer).

The training cases on one thread, as a training actor has (`train.torch_threads`); the decoding one
on every core, as evaluation runs. Each line: `name ratio` (old / new
seconds, the median of `--repeats`). `--tokens` and `--set` (settings over the demo's in every
training case) make a smaller run.

    .venv/bin/python -m bench.demo_step [--repeats 5] [--tokens 166] [--set KEY=VALUE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

from bench.scratch import scratch


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _loss_case(args) -> tuple[float, float]:
    import torch
    from torch.utils.checkpoint import checkpoint

    from dflash_ray.drafter.dspark import Settings, _position_losses

    g = torch.Generator().manual_seed(0)
    n, hidden, vocab, rank = 224, 576, 49152, 64
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    markov = torch.randn(n, rank, generator=g).requires_grad_()
    conf = torch.zeros(n)
    head = torch.randn(vocab, hidden, generator=g) * hidden**-0.5
    w2 = (torch.randn(vocab, rank, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    teacher = torch.randn(n, hidden, generator=g)
    inputs = (h, markov, conf, head, w2, labels, teacher, Settings())

    def recomputed():
        per, _ = checkpoint(_position_losses, *inputs, use_reentrant=False)
        per.sum().backward()

    def kept():
        per, _ = _position_losses(*inputs)
        per.sum().backward()

    return _median_seconds(recomputed, args.repeats), _median_seconds(kept, args.repeats)


def _sample(tokens: int) -> str:
    """One tokenized file of one sample of `tokens` tokens (a demo-length one: 166), the last 78% the
    answer."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    ids = torch.randint(0, 49152, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = tokens * 36 // 166
    mask = [0] * prompt + [1] * (tokens - prompt)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"input_ids": ids, "loss_mask": mask, "seq_len": tokens}]), buf)
    part = f"{scratch('bench-demo-step-')}/part-0.parquet"
    with open(part, "wb") as f:
        f.write(buf.getvalue())
    return part


LAYERS = [1, 8, 15, 22, 28]  # five captured layers of SmolLM2's 30


def _cache_case(args) -> tuple[float, float]:
    from dflash_ray.config import load_config
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.train.target_worker import TargetWorker

    part = _sample(args.tokens)
    settings = ["train.drafter=dspark", "train.torch_threads=1", *args.set]
    plain = TargetWorker(SMOLLM2, LAYERS, load_config(None, settings + ["train.feature_cache_gb=0"]).train)
    cached = TargetWorker(SMOLLM2, LAYERS, load_config(None, settings + ["train.feature_cache_gb=1"]).train)
    cached.features([(part, 0)])  # the first epoch's forward
    return _median_seconds(lambda: plain.features([(part, 0)]), args.repeats), _median_seconds(
        lambda: cached.features([(part, 0)]), args.repeats
    )


def _dtype_case(args) -> tuple[float, float]:
    return _step_case(args, ["train.dtype=float32"], ["train.dtype=bfloat16"])


def _hard_label_case(args) -> tuple[float, float]:
    # tv_weight 1e-9: the target's distribution computed, as hard labels alone computed it before
    return _step_case(args, ["train.family.tv_weight=1e-9"], ["train.family.tv_weight=0"])


def _hard_label_target_case(args) -> tuple[float, float]:
    """The target's batch for the demo's drafter, as it was with hard labels alone (tv_weight 1e-9
    reads the last hidden states) against now."""
    from dflash_ray.config import load_config
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.demo import DEMO_SETTINGS
    from dflash_ray.train.target_worker import TargetWorker

    part = _sample(args.tokens)
    seconds = []
    for tv in ("1e-9", "0"):  # each batch a forward: the feature cache off
        overrides = ["train.torch_threads=1", *args.set, "train.feature_cache_gb=0", f"train.family.tv_weight={tv}"]
        cfg = load_config(None, DEMO_SETTINGS + overrides)
        layers = drafter_config(SMOLLM2, cfg)["target_layer_ids"]
        target = TargetWorker(SMOLLM2, layers, cfg.train)
        seconds.append(_median_seconds(lambda: target.features([(part, 0)]), args.repeats))
    return seconds[0], seconds[1]


def _step_case(args, old: list[str], new: list[str]) -> tuple[float, float]:
    """A training step of the demo's drafter on one demo-length sample, under two sets of settings."""
    import json as json_

    from dflash_ray.config import load_config
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.demo import DEMO_SETTINGS
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    part = _sample(args.tokens)
    seconds = []
    for settings in (old, new):
        cfg = load_config(None, DEMO_SETTINGS + ["train.num_streams=1", "train.torch_threads=1", *args.set, *settings])
        drafter_json = json_.dumps(drafter_config(SMOLLM2, cfg))
        layers = json_.loads(drafter_json)["target_layer_ids"]
        batch = TargetWorker(SMOLLM2, layers, cfg.train).features([(part, 0)])
        worker = DrafterWorker(SMOLLM2, drafter_json, "auto", cfg.train, 0, 1)
        step = iter(range(10**6))
        seconds.append(_median_seconds(lambda: worker.train_step(next(step), batch), args.repeats))
    return seconds[0], seconds[1]


def _head_case(args) -> tuple[float, float]:
    import torch

    from dflash_ray.drafter.model import head_logits

    g = torch.Generator().manual_seed(0)
    head, block = torch.randn(49152, 576, generator=g), torch.randn(7, 576, generator=g)
    many = 20  # one step's product is milliseconds: time 20 of them
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return (
            _median_seconds(lambda: [block @ head.t() for _ in range(many)], args.repeats) / many,
            _median_seconds(lambda: [head_logits(block, head) for _ in range(many)], args.repeats) / many,
        )
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=166, help="the training cases' sample (a demo-length one)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="over the demo's, every training case"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cases = {
        "dspark_loss_recomputed_over_kept": _loss_case,
        "target_forward_over_cache": _cache_case,
        "drafter_step_fp32_over_bf16": _dtype_case,
        "block_head_product_over_head_first": _head_case,
        "hard_label_step_target_distribution_over_skipped": _hard_label_case,
        "hard_label_target_last_hidden_over_features_alone": _hard_label_target_case,
    }
    result = {}
    for name, case in cases.items():
        old, new = case(args)
        result[name] = {"old_s": round(old, 4), "new_s": round(new, 4), "ratio": round(old / new, 2)}
        if not args.json:
            print(f"{name} {old / new:.2f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
