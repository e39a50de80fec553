"""`make gpu-check`'s layout step: one drafter rank of the preset's layout (hsdp: the weights
sharded over a node's 8 ranks and replicated across 2 nodes, gradients reduced in bf16, the layers
kept gathered from forward to backward), run on one device over a fake process group of 16 ranks.
The collectives move nothing (one GPU cannot hold 16 ranks), so what it measures is the rank's own
compute and memory under that layout, and the bytes its collectives would send, each beside the
plan's simulation of the same step (`simulate.drafter_step`). Ray-free.
"""

from __future__ import annotations

import statistics
import time

import torch


def _fake_mesh(world: int, replicas: int, device_type: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh(device_type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    return mesh, {mesh.get_group(d).group_name: d for d in ("replicate", "shard")}


def check_layout_step(sz, device: str, world: int, replicas: int) -> dict:
    """`sz`: bench.gpu's sizes (the reference drafter's width, anchors, sequence length)."""
    import torch.distributed as dist
    from transformers import Qwen3Config

    from dflash_ray.drafter import families
    from dflash_ray.drafter.config import from_target
    from dflash_ray.planning import COMPUTE_EFFICIENCY, OPTIMIZER_BANDWIDTH_EFFICIENCY, OPTIMIZER_PASSES
    from dflash_ray.gpus import GPUS
    from dflash_ray.simulate import Sample, drafter_step
    from dflash_ray.simulate_traffic import CountedTraffic
    from dflash_ray.train.fsdp import apply_fsdp

    cuda = device.startswith("cuda")
    target = Qwen3Config(
        vocab_size=sz.vocab,
        hidden_size=sz.hidden,
        intermediate_size=sz.intermediate,
        num_hidden_layers=sz.target_layers,
        num_attention_heads=sz.heads,
        num_key_value_heads=sz.kv_heads,
        head_dim=sz.head_dim,
    )
    dcfg = from_target(
        target,
        mask_token_id=sz.vocab - 1,
        num_layers=sz.drafter_layers,
        target_layer_ids=sz.layer_ids,
        layer_types=sz.layer_types,
        sliding_window=sz.sliding_window,
    )
    prompt = sz.seq_len // 8
    step_args = dict(num_anchors=sz.anchors, gamma=7.0, length_bucket=sz.length_bucket)
    planned = drafter_step(
        dcfg,
        dcfg.family,
        Sample(sz.seq_len, prompt),
        world=world,
        replicas=replicas,
        reduce_dtype=torch.bfloat16,
        keep_gathered=True,
        tied_head=True,
        teacher_k=0,
        distill=0.0,
        **step_args,
    )
    family = families.get(dcfg.family)
    mesh, names = _fake_mesh(world, replicas, "cuda" if cuda else "cpu")
    try:
        drafter = family.build(dcfg).to(device)
        apply_fsdp(drafter, mesh.device_type, mesh, torch.bfloat16, reduce_dtype=torch.bfloat16, keep_gathered=True)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
        embed = torch.randn(sz.vocab, sz.hidden, device=device, dtype=torch.bfloat16)
        features = torch.randn(1, sz.seq_len, len(sz.layer_ids) * sz.hidden, device=device, dtype=torch.bfloat16)
        ids = torch.randint(0, sz.vocab - 1, (1, sz.seq_len), device=device)
        mask = torch.ones(1, sz.seq_len, dtype=torch.long, device=device)
        mask[:, :prompt] = 0
        traffic = CountedTraffic(names)

        def step(i: int) -> float:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(mesh.device_type, dtype=torch.bfloat16):
                out = family.forward_loss(
                    drafter,
                    embed,
                    embed,
                    features,
                    ids,
                    mask,
                    generator=torch.Generator().manual_seed(i),
                    attention="flex" if cuda else "sdpa",
                    teacher=None,
                    distill=0.0,
                    **step_args,
                )
            out.loss.loss.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        for i in range(sz.warmup):  # compiles, AdamW's moments
            step(i)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with traffic:
            step(sz.warmup)
        seconds = statistics.median(step(sz.warmup + 1 + i) for i in range(sz.steps))
        peak_gb = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    finally:
        dist.destroy_process_group()
    counted = traffic.gigabytes()
    gpu = GPUS["H200"]
    shard_gb = planned["parameters"] * 4 / (world // replicas) / 1e9
    planned_s = planned["flops_per_step"] / (gpu.bf16_tflops * 1e12 * COMPUTE_EFFICIENCY) + shard_gb * (
        OPTIMIZER_PASSES / (gpu.bandwidth_tbs * 1e3 * OPTIMIZER_BANDWIDTH_EFFICIENCY)
    )
    traffic_ratio = {d: round(counted.get(d, 0.0) / v, 3) for d, v in planned["traffic_gb"].items() if v}
    return {
        "check": "layout_step",
        "ok": bool(traffic_ratio) and all(0.9 <= r <= 1.1 for r in traffic_ratio.values()),
        "layout": {"kind": "hsdp", "replicas": replicas, "shard": world // replicas, "reduce": "bfloat16"},
        "traffic_gb": counted,
        "planned_traffic_gb": planned["traffic_gb"],
        "traffic_ratio": traffic_ratio,
        "step_s": round(seconds, 4),
        "planned_compute_s_h200": round(planned_s, 4),  # the plan's rank compute (no traffic: the group is fake)
        "step_over_planned": round(seconds / planned_s, 3) if cuda else None,
        "peak_gb": round(peak_gb, 2) if peak_gb is not None else None,
        "planned_peak_gb": planned["memory_gb"]["total"],
        "note": "collectives on a fake group: compute and memory of one rank, bytes counted, none moved",
    }
