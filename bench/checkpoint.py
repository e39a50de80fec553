"""How long a checkpoint holds up the training step: each rank's shard copied to host memory and
written in the background (`train/checkpoint_files.py`) against gathering the whole fp32 weights and both
AdamW moments onto rank 0 and serializing them there before any upload (what a whole-file checkpoint
needs), side by side in one run, alternating.

Two gloo ranks in two processes on one machine hold an FSDP2-sharded drafter of about 100M
parameters by default (2 layers at hidden 2,048, MLP 8,192: about 1.2 GB of weights and moments).
Each case times, on every rank, the call that the step makes until it may go on, then (outside the
timing) waits for the files; the maximum over ranks is the step's hold-up. Printed: both medians,
the ratio, and the bytes the largest rank's file holds against the whole state.

    .venv/bin/python -m bench.checkpoint [--hidden 2048] [--layers 2] [--iters 3] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _drafter(hidden: int, layers: int):
    from transformers import Qwen3Config

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.model import DFlashDrafter

    target = Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=8,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
    )
    torch.manual_seed(0)
    return DFlashDrafter(from_target(target, mask_token_id=500, num_layers=layers, target_layer_ids=[0, 1]))


def _gather_whole(drafter, opt, rank: int) -> bytes:
    """Every tensor gathered whole onto rank 0's host and serialized there (the former path)."""
    from dflash_ray.train.fsdp import full

    keep = lambda t: full(t.detach()).cpu() if rank == 0 else (full(t.detach()), None)[1]
    weights = {n: keep(t) for n, t in drafter.state_dict().items()}
    state = {n: {k: keep(v) for k, v in opt.state[p].items()} for n, p in drafter.named_parameters()}
    if rank:
        return b""
    buf = io.BytesIO()
    torch.save({"weights": weights, "optimizer": state}, buf)
    return buf.getvalue()


def _rank(rank: int, port: int, args, results) -> None:
    from dflash_ray.train import checkpoint_files
    from dflash_ray.train.fsdp import apply_fsdp, optimizer_bytes

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600)
    )
    torch.set_num_threads(1)
    drafter = _drafter(args.hidden, args.layers)
    apply_fsdp(drafter, "cpu", dist.group.WORLD, torch.float32)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    for p in drafter.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    group = dist.new_group(backend="gloo")
    seconds = {"whole_to_rank0": [], "sharded_async": []}
    file_bytes = 0
    for i in range(args.iters + 1):  # the first round warms up and is not counted
        for case in seconds:
            dist.barrier()
            start = time.perf_counter()
            if case == "whole_to_rank0":
                _gather_whole(drafter, opt, rank)
                held = time.perf_counter() - start
            else:
                folder = tempfile.mkdtemp(prefix="bench-ckpt-")
                upload = checkpoint_files.save(drafter, opt, folder, group, {})
                held = time.perf_counter() - start
                entries = upload.result()  # the background write, outside the timing
                file_bytes = max(e["bytes"] for e in entries.values())
                shutil.rmtree(folder, ignore_errors=True)
            if i:
                seconds[case].append(held)
    local = sum(p.to_local().numel() * 4 for p in drafter.parameters()) + optimizer_bytes(opt)
    results[rank] = {"seconds": seconds, "file_bytes": file_bytes, "local_bytes": local}
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dflash_ray.train.streams import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), args, results), nprocs=2, join=True)
    held = {
        case: statistics.median(max(results[r]["seconds"][case][i] for r in (0, 1)) for i in range(args.iters))
        for case in ("whole_to_rank0", "sharded_async")
    }
    whole = sum(results[r]["local_bytes"] for r in (0, 1))
    row = {
        "bench": "checkpoint",
        "case": f"2_ranks_hidden{args.hidden}_x{args.layers}_layers_{whole / 1e9:.2f}GB",
        "whole_to_rank0_s": round(held["whole_to_rank0"], 3),
        "sharded_async_s": round(held["sharded_async"], 3),
        "whole_over_sharded": round(held["whole_to_rank0"] / held["sharded_async"], 2),
        "largest_file_over_state": round(max(results[r]["file_bytes"] for r in (0, 1)) / whole, 3),
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
