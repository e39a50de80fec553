"""One training stream, target actor → drafter actor, each pinned to one core (torch threads 1).

Measures steps/s of the pipelined stream (the target computes step t+1 while the drafter trains on
step t) against the ideal 1 / max(t_target, t_drafter), the same two actors one after the other,
and the in-process baseline (target and drafter in one process, one after the other), with the
SmolLM2-135M-Instruct target on sequences of `--seq-len` tokens.

    .venv/bin/python -m bench.train [--steps 16] [--seq-len 512] [--anchors 64] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time

from bench.scratch import scratch


def _data(folder: str, n: int, seq_len: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from dflash_ray import manifest, storage

    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "id": f"s{i}",
            "source": "bench",
            "input_ids": torch.randint(100, 40000, (seq_len,), generator=g).tolist(),
            "loss_mask": [0] * (seq_len // 8) + [1] * (seq_len - seq_len // 8),
            "seq_len": seq_len,
            "truncated": False,
        }
        for i in range(n)
    ]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.write_bytes(storage.join(folder, "part-0.parquet"), buf.getvalue())
    manifest.write_manifest(folder, kind="tokenized", files=[{"name": "part-0.parquet", "rows": n}], summary={})


def _stream(target: str, data: str, out: str, settings: list[str]) -> dict:
    from dflash_ray.config import load_config
    from dflash_ray.stages.train import run_train

    cfg = load_config(None, settings)
    run_train(target, data, out, cfg, progress=False)
    metrics = [json.loads(x) for x in open(f"{out}/metrics.jsonl")][2:]  # warm-up steps left out
    return {
        "steps_per_s": 1 / statistics.median(m["step_seconds"] for m in metrics),
        "t_target": statistics.median(m["target_seconds"] for m in metrics),
        "t_drafter": statistics.median(m["drafter_seconds"] for m in metrics),
    }


def _fused(target: str, data: str, settings: list[str], steps: int) -> float:
    import json as _json

    import torch

    from dflash_ray.config import load_config
    from dflash_ray.train.shape import drafter_config, drafter_init
    from dflash_ray.train.schedule import Schedule, dataset_samples
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    cfg = load_config(None, settings)
    torch.set_num_threads(1)
    dcfg = drafter_config(target, cfg)
    tw = TargetWorker(target, dcfg["dflash_config"]["target_layer_ids"], cfg.train)
    dw = DrafterWorker(target, _json.dumps(dcfg), drafter_init(target, cfg), cfg.train, 0, 1)
    dw.set_total_steps(steps)
    schedule = Schedule(dataset_samples(data), 1, 1, 0)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        dw.train_step(step, tw.features(schedule.batch_for(step, 0)))
        times.append(time.perf_counter() - start)
    return 1 / statistics.median(times[2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--anchors", type=int, default=64, help="blocks a sample a step (train.num_anchors)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from bench.local_ray import local_ray
    from dflash_ray.registry import SMOLLM2, resolve

    target = resolve(SMOLLM2)
    work = scratch("bench-train-")
    _data(f"{work}/data", args.steps, args.seq_len)
    base = [
        "train.num_streams=1",
        "train.actor_cpus=1",
        "train.torch_threads=1",
        "train.num_layers=1",
        f"train.num_anchors={args.anchors}",
        f"train.checkpoint_every={args.steps}",
        "train.epochs=1",
    ]
    with local_ray(num_cpus=2):
        pipelined = _stream(target, f"{work}/data", f"{work}/pipe", base + ["train.max_in_flight=1"])
        sequential = _stream(target, f"{work}/data", f"{work}/seq", base + ["train.max_in_flight=0"])
    fused = _fused(target, f"{work}/data", base, args.steps)
    ideal = 1 / max(pipelined["t_target"], pipelined["t_drafter"])
    row = {
        "case": f"smollm2_seq{args.seq_len}_1layer_{args.anchors}anchors",
        "t_target_s": round(pipelined["t_target"], 3),
        "t_drafter_s": round(pipelined["t_drafter"], 3),
        "ideal_steps_per_s": round(ideal, 3),
        "pipelined_steps_per_s": round(pipelined["steps_per_s"], 3),
        "sequential_steps_per_s": round(sequential["steps_per_s"], 3),
        "fused_steps_per_s": round(fused, 3),
        "pipeline_efficiency": round(pipelined["steps_per_s"] / ideal, 3),
        "sequential_efficiency": round(sequential["steps_per_s"] / ideal, 3),
        "fused_ratio": round(pipelined["steps_per_s"] / fused, 3),
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k:>24}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
