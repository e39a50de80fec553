"""The drafters' layouts (`train/mesh.py`, `train/fsdp.py`) on real gloo ranks, and the plan's view
of them: rows kept inside nodes, the bytes the plan counts on a fake group equal to what real ranks
send, one step's gradients the same under every layout, and gradients reduced in bf16 training as
fp32's do."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from conftest import spawn
from dflash_ray.train.mesh import balanced, dims_cross_nodes, rows_of, shape_of

WIDTH = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)


def _drafter_cfg():
    from transformers import Qwen3Config

    from dflash_ray.drafter.config import from_target

    target = Qwen3Config(num_key_value_heads=2, head_dim=32, **WIDTH)
    return from_target(target, mask_token_id=511, num_layers=2, target_layer_ids=[1, 2])


def test_a_mesh_over_unequal_nodes_keeps_rows_of_one_size_and_the_fewest_passes():
    """`mesh.balanced` under train.lost_streams=stand_in: 8 and 7 ranks of 16 wanted make one row of
    8 (two passes, as 15 rows of one would), the 7 idle; every rank stays where all fit one pass or
    the nodes are equal; 2 and 1 of 4 make one row of 2; fsdp and replicate keep every rank."""
    uneven = ["a"] * 8 + ["b"] * 7
    kept = balanced("hsdp", uneven, 16, stand_in=True)
    assert kept == list(range(8)) and rows_of("hsdp", [uneven[i] for i in kept]) == [list(range(8))]
    assert balanced("hsdp", uneven, 15, stand_in=True) == list(range(15))  # 15 wide: one pass, every rank
    assert balanced("hsdp", ["a"] * 8 + ["b"] * 8, 16, stand_in=True) == list(range(16))
    assert balanced("hsdp", ["a"] * 8 + ["b"] * 4, 12, stand_in=True) == list(range(12))  # rows of 4, one pass
    assert balanced("hsdp", ["a"] * 8 + ["b"] * 4, 16, stand_in=True) == list(range(8))  # two passes either way
    assert balanced("hsdp", ["a", "a", "b"], 4, stand_in=True) == [0, 1]
    every = list(range(3))
    assert balanced("fsdp", ["a", "a", "b"], 4, stand_in=True) == balanced("replicate", ["a", "a", "b"], 4) == every


def test_a_shrunk_mesh_keeps_the_most_ranks_in_rows_of_at_least_half_a_node():
    """`mesh.balanced` under train.lost_streams=shrink (a batch a training rank, one pass): 8 and 7
    ranks make two rows of 7 (14 train, the 8th of the first node idle), not 15 rows of one rank
    (the whole drafter and its gradient on every rank); 8 and 6 two rows of 6; 8 and 5 three rows
    of 4; equal nodes and a lone node keep every rank; 2 and 1 keep all three as rows of one (half
    of two is one)."""
    uneven = ["a"] * 8 + ["b"] * 7
    kept = balanced("hsdp", uneven, 16)
    assert kept == [*range(7), *range(8, 15)]
    assert rows_of("hsdp", [uneven[i] for i in kept]) == [list(range(7)), list(range(7, 14))]
    assert len(balanced("hsdp", ["a"] * 8 + ["b"] * 6, 16)) == 12
    assert len(balanced("hsdp", ["a"] * 8 + ["b"] * 5, 16)) == 12
    assert balanced("hsdp", ["a"] * 8 + ["b"] * 8, 16) == list(range(16))
    assert balanced("hsdp", ["a"] * 7, 8) == list(range(7))
    assert balanced("hsdp", ["a", "a", "b"], 4) == [0, 1, 2]


def test_layout_rows_shard_inside_a_node_and_replicate_across():
    nodes = ["a", "a", "b", "b", "a", "b"]
    assert rows_of("hsdp", nodes) == [[0, 1, 4], [2, 3, 5]]
    assert rows_of("fsdp", nodes) == [[0, 1, 2, 3, 4, 5]] and rows_of("replicate", nodes)[-1] == [5]
    assert rows_of("hsdp", ["a", "a", "a", "a", "b", "b"]) == [[0, 1], [2, 3], [4, 5]]  # equal rows, in a node
    assert shape_of("hsdp", 16, 8) == (2, 8) and shape_of("hsdp", 4, 8) == (1, 4)
    assert dims_cross_nodes("hsdp", 16, 8) == {"shard": False, "replicate": True}
    assert dims_cross_nodes("fsdp", 16, 8)["shard"] and not dims_cross_nodes("fsdp", 8, 8)["shard"]


def _rank(rank: int, world: int, store: str, jobs: list[dict], out: str) -> None:
    """One gloo rank: for each job, the tiny drafter sharded by the job's layout, `steps` steps of
    one sequence each (the ranks' union), the loss and the bytes each mesh dimension's
    collectives sent in the first."""
    import torch.distributed as dist

    from dflash_ray.drafter import families
    from dflash_ray.simulate_traffic import CountedTraffic
    from dflash_ray.train.fsdp import apply_fsdp, make_mesh_groups, mesh_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dcfg = _drafter_cfg()
    family = families.get(dcfg.family)
    results = []
    for job in jobs:
        torch.manual_seed(0)
        drafter = family.build(dcfg)
        rows = rows_of(job["layout"], job["nodes"])
        if len(rows) > 1:
            groups = make_mesh_groups(rows, None)
            mesh = mesh_of(rows, groups, "cpu")
            names = {groups[0].group_name: "shard", groups[1].group_name: "replicate"}
        else:
            mesh, names = dist.group.WORLD, {dist.group.WORLD.group_name: "shard"}
        reduce = getattr(torch, job["reduce"])
        apply_fsdp(drafter, "cpu", mesh, torch.bfloat16, reduce_dtype=reduce, keep_gathered=job["keep"])
        opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
        data = torch.Generator().manual_seed(rank)
        embed = torch.randn(512, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
        losses, sent = [], {}
        for step in range(job["steps"]):
            S = 96
            ids = torch.randint(0, 511, (1, S), generator=data)
            mask = torch.ones(1, S, dtype=torch.long)
            mask[:, :16] = 0
            features = torch.randn(1, S, 2 * 128, generator=data).bfloat16()
            traffic = CountedTraffic(names)

            def forward(batch, generator, grad, **extra):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return family.forward_loss(
                        drafter, embed, embed, *batch["args"], num_anchors=16, generator=generator,
                        attention="sdpa", gamma=7.0, teacher=None, distill=0.0, length_bucket=32,
                    )  # fmt: skip

            with traffic if step == 0 else contextlib.nullcontext():
                if job.get("passes", 1) == 1:
                    opt.zero_grad(set_to_none=True)
                    loss = forward({"args": (features, ids, mask)}, torch.Generator().manual_seed(step), True).loss
                    (loss.loss / world).backward()
                else:  # a rank standing in for lost streams: its batch and one more, accumulated
                    loss = _accumulated(drafter, opt, family, forward, (features, ids, mask), job["passes"], step)
                opt.step()
            if step == 0:
                sent = dict(traffic.bytes)
            total = loss.loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
        results.append({"losses": losses, "bytes": sent})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _accumulated(drafter, opt, family, forward, args, passes: int, step: int):
    """`gradients.accumulated` on a rank whose worker is only what it reads."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from dflash_ray.train import gradients

    worker = SimpleNamespace(
        drafter=drafter, opt=opt, family=family, place=SimpleNamespace(device="cpu"), group=dist.group.WORLD,
        cfg=SimpleNamespace(loss_decay=7.0, distill=0.0), generator=torch.Generator().manual_seed(step),
        flops_per_position=0, _forward=forward,
    )  # fmt: skip
    batches = iter([{"args": args, "seconds": 0.0, "loss_mask": args[2]}] * passes)
    _, loss, _ = gradients.accumulated(worker, batches, passes)
    return SimpleNamespace(loss=torch.tensor(loss))  # the union's, on every rank


def _run(tmp_path, world: int, jobs: list[dict]) -> list[dict]:
    out = tmp_path / "results.json"
    store = tmp_path / "store"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spawn(_rank, (world, str(store), jobs, str(out)), world)
    return json.loads(out.read_text())


def _planned(world: int, replicas: int, keep: bool) -> dict[str, float]:
    """The plan's count: the same drafter and step on a fake group, as `plan` simulates it."""
    from dflash_ray.simulate import Sample, drafter_step

    dcfg = _drafter_cfg()
    step = drafter_step(
        dcfg,
        dcfg.family,
        Sample(96, 16),
        num_anchors=16,
        world=world,
        replicas=replicas,
        reduce_dtype=torch.bfloat16,
        keep_gathered=keep,
        tied_head=True,
        teacher_k=0,
        distill=0.0,
        gamma=7.0,
        length_bucket=32,
    )
    return step["traffic_gb"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_traffic_the_plan_counts_is_what_real_gloo_ranks_send_and_every_layout_trains_alike(tmp_path):
    """Four gloo ranks on two 'nodes': one step of the tiny drafter sharded over all four (fsdp),
    over each node's two and replicated across (hsdp), and whole on each (replicate). The bytes each
    mesh dimension sends are within a tenth of the plan's count on a fake group at the same width and
    rank count; every layout computes the same step (the same loss after it)."""
    nodes = ["a", "a", "b", "b"]
    layouts = [("fsdp", 1, False), ("hsdp", 2, True), ("replicate", 4, True)]
    jobs = [dict(layout=k, nodes=nodes, reduce="bfloat16", keep=keep, steps=2) for k, _, keep in layouts]
    results = _run(tmp_path, 4, jobs)
    for (kind, replicas, keep), got in zip(layouts, results):
        planned = _planned(4, replicas, keep)
        real = {dim: b / 1e9 for dim, b in got["bytes"].items()}
        assert set(planned) == set(real), (kind, planned, real)
        for dim in planned:
            assert abs(planned[dim] - real[dim]) <= 0.1 * real[dim], (kind, dim, planned, real)
    first = [r["losses"][0] for r in results]
    second = [r["losses"][1] for r in results]
    assert max(first) - min(first) < 1e-6, first  # the same weights and batches
    assert max(second) - min(second) <= 0.01 * abs(second[0]), second  # one step later: bf16 sums in another order
    # hsdp sends less than a quarter of fsdp's bytes across the nodes: only the replicate all-reduce
    assert results[1]["bytes"]["replicate"] < 0.25 * results[0]["bytes"]["shard"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_layout_bf16_reduce_trains_within_a_percent_of_fp32(tmp_path):
    """100 steps on two ranks, gradients reduce-scattered in bf16 against fp32 from the same start:
    the mean loss of the run stays within 1% (bench/RESULTS.md keeps the figures)."""
    jobs = [dict(layout="fsdp", nodes=["a", "a"], reduce=r, keep=True, steps=100) for r in ("float32", "bfloat16")]
    fp32, bf16 = (r["losses"] for r in _run(tmp_path, 2, jobs))
    mean32, mean16 = sum(fp32) / len(fp32), sum(bf16) / len(bf16)
    assert abs(mean16 - mean32) <= 0.01 * mean32, (mean32, mean16)
    assert sum(fp32[-10:]) < sum(fp32[:10])  # it learned: the figure compares two runs that train
    print(json.dumps({"fp32_mean_loss": mean32, "bf16_mean_loss": mean16, "ratio": mean16 / mean32}))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_placed_of_four_train_on_a_balanced_mesh_with_no_byte_across_the_nodes(tmp_path):
    """Four streams wanted, three placed on two 'nodes' (two and one): `mesh.balanced` keeps the
    first node's two under train.lost_streams=stand_in, one row (two passes a step for the four
    streams' batches, as three ranks would make), so no byte of the drafter's collectives crosses
    the nodes; under shrink all three train a batch each, on rows of one rank (plain replication):
    one all-reduce of the whole gradient across them a step."""
    from dflash_ray.train.schedule import passes

    placed = ["a", "a", "b"]
    kept = balanced("hsdp", placed, 4, stand_in=True)
    assert kept == [0, 1] and passes(len(kept), 4) == passes(len(placed), 4) == 2
    assert balanced("hsdp", placed, 4) == [0, 1, 2]  # train.lost_streams=shrink: all three, one pass
    job = dict(layout="hsdp", reduce="float32", keep=True, steps=1, passes=2)
    for name in ("balanced", "every"):
        (tmp_path / name).mkdir()
    row = _run(tmp_path / "balanced", 2, [dict(job, nodes=[placed[i] for i in kept])])[0]
    every = _run(tmp_path / "every", 3, [dict(job, nodes=placed, passes=1)])[0]
    assert rows_of("hsdp", [placed[i] for i in kept]) == [[0, 1]] and set(row["bytes"]) == {"shard"}, row
    assert every["bytes"].get("replicate", 0) > row["bytes"]["shard"] / 2, (row, every)
    assert row["losses"][0] > 0 and every["losses"][0] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_step_of_two_accumulated_passes_all_reduces_across_the_rows_once(tmp_path):
    """Four gloo ranks on two 'nodes' (hsdp: a row each), each rank standing in for a lost stream
    (two passes a step, `gradients.accumulated`): the passes reduce-scatter inside a row, and the
    rows' all-reduce runs once a step, sending what a one-pass step sends, not twice it."""
    nodes = ["a", "a", "b", "b"]
    jobs = [dict(layout="hsdp", nodes=nodes, reduce="float32", keep=True, steps=1, passes=p) for p in (1, 2)]
    one, two = (r["bytes"] for r in _run(tmp_path, 4, jobs))
    assert two["replicate"] <= 1.01 * one["replicate"], (one, two)
    assert two["shard"] >= 1.5 * one["shard"], (one, two)  # the passes' own gathers and reduce-scatters
