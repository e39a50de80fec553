"""Two drafters from one target pass (`train.drafters`) against two separate runs, side by side on
the same data: a DFlash and a DSpark drafter (one layer each) on the SmolLM2-135M-Instruct target,
one stream, sequences of `--seq-len` tokens, each actor on one torch thread.

Printed, one ratio per line: the wall time of the whole job (actor starts, target passes,
checkpoints), and the median step time after two warm-up steps (one run's step trains both).

    .venv/bin/python -m bench.drafters [--steps 12] [--seq-len 512] [--anchors 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.scratch import scratch
from bench.train import _data

DSPARK = {"drafter": "dspark", "family": {"markov_rank": 64}}


def _run(target: str, data: str, out: str, settings: list[str]) -> tuple[float, dict]:
    from dflash_ray.config import load_config
    from dflash_ray.stages.train import run_train

    start = time.perf_counter()
    summary = run_train(target, data, out, load_config(None, settings), progress=False)
    return time.perf_counter() - start, summary


def _step_s(folder: str) -> float:
    metrics = [json.loads(x) for x in open(f"{folder}/metrics.jsonl")][2:]  # warm-up steps left out
    return statistics.median(m["step_seconds"] for m in metrics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--anchors", type=int, default=64, help="blocks a sample a step (train.num_anchors)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from bench.local_ray import local_ray
    from dflash_ray.registry import SMOLLM2, resolve

    target = resolve(SMOLLM2)
    work = scratch("bench-drafters-")
    _data(f"{work}/data", args.steps, args.seq_len)
    base = [
        "train.num_streams=1",
        "train.actor_cpus=0.5",
        "train.torch_threads=1",
        "train.num_layers=1",
        f"train.num_anchors={args.anchors}",
        f"train.checkpoint_every={args.steps}",
        "train.epochs=1",
        "train.distill_top_k=16",
    ]
    both = json.dumps([{"name": "dflash"}, {"name": "dspark", **DSPARK}]).replace('"', "")
    with local_ray(num_cpus=2):
        together, summary = _run(target, f"{work}/data", f"{work}/together", base + [f"train.drafters={both}"])
        alone_dflash, _ = _run(target, f"{work}/data", f"{work}/dflash", base)
        alone_dspark, _ = _run(
            target, f"{work}/data", f"{work}/dspark", base + [f"train.{k}={v}" for k, v in DSPARK.items()]
        )
    step_together = _step_s(f"{work}/together/dflash")
    step_separate = _step_s(f"{work}/dflash") + _step_s(f"{work}/dspark")
    row = {
        "case": f"smollm2_seq{args.seq_len}_{summary['step']}steps_dflash+dspark_1layer",
        "together_s": round(together, 1),
        "separate_s": round(alone_dflash + alone_dspark, 1),
        "wall_separate_over_together": round((alone_dflash + alone_dspark) / together, 2),
        "step_s_together": round(step_together, 3),
        "step_s_separate": round(step_separate, 3),
        "step_separate_over_together": round(step_separate / step_together, 2),
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
