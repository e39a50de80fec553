"""The real run's clocks on the CPU (`train.clocks`): a compile on a shape's first use, NCCL's
watchdog on its own thread counting from the post, a deadline on every wait of the coordinator.
Each test runs the paired path (features by send/recv under NCCL's rules) on a local Ray cluster
with a tiny target."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_ray import manifest, storage
from dflash_ray.config import load_config
from dflash_ray.stages.train import run_train
from test_train import SETTINGS, data, target  # noqa: F401  (the tiny training run's fixtures)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def many_lengths(tmp_path_factory):
    """144 samples of 48 lengths (16 to 392 tokens, a multiple of 8 each): with train.length_bucket=8
    each length is a graph shape of its own, as a real run's buckets are."""
    folder = str(tmp_path_factory.mktemp("lengths"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(144):
        n = 8 * (2 + i % 48)
        rows.append(
            {
                "id": f"p{i}",
                "source": "x",
                "input_ids": torch.randint(0, 490, (n,), generator=g).tolist(),
                "loss_mask": [0] * 4 + [1] * (n - 4),
                "seq_len": n,
                "truncated": False,
            }
        )
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.write_bytes(storage.join(folder, "part-0.parquet"), buf.getvalue())
    manifest.write_manifest(folder, kind="tokenized", files=[{"name": "part-0.parquet", "rows": len(rows)}], summary={})
    return folder


# The preset's proportions at 1/100: NCCL's watchdog 300 s -> 3 s, a compile 10 s -> 0.1 s. Held out:
# 72 samples, 36 evaluation batches a stream, most of them a padded length of their own.
CLOCKED = [
    "train.actor_cpus=0.5",
    "train.num_layers=1",
    "train.target_layer_ids=[0,1,2]",
    "train.num_anchors=8",
    "train.length_bucket=8",
    "train.heldout=72",
    "train.eval_every=6",
    "train.max_steps=6",
    "train.checkpoint_every=100",
    "train.collective_timeout_s=300",
    "train.clocks.scale=0.01",
    "train.max_restarts=0",
]


@pytest.mark.timeout(600)
def test_clock_the_first_evaluation_posts_no_send_that_ages_past_the_watchdog(
    ray_cluster, target, many_lengths, tmp_path
):  # noqa: F811
    """Under the GPU's clocks an evaluation that posted every held-out batch's features at once had
    its later sends wait behind the drafters' compiles past NCCL's watchdog, which ended the target
    (and with no restart left, the run). Every shape is now met before step 0, and an evaluation goes
    in waves no deeper than training's window: no send ages, the run finishes without a restart."""
    summary = run_train(target, many_lengths, str(tmp_path / "run"), load_config(None, CLOCKED), progress=False)
    assert summary["step"] == 6 and summary["restarts"] == 0, summary["failures"]
    warm = summary["warm_up"]
    assert len(warm) == 1 and warm[0]["shapes"] > 48, warm  # training's lengths and evaluation's, before step 0
    assert summary["heldout_tau_start"] is not None and summary["heldout_tau"] is not None


@pytest.mark.timeout(600)
def test_deadline_names_a_target_blocked_in_its_reader_and_the_run_restarts_and_finishes(
    ray_cluster,
    target,  # noqa: F811
    data,  # noqa: F811
    tmp_path,
):
    """Target 1 blocks forever reading step 3's samples (`train.stall_step`), alive, with no send
    posted: no watchdog sees it. The coordinator's wait for its features ends at the deadline, names
    it, and the run restarts and takes every step once."""
    settings = SETTINGS + ["train.stall_step=3", "train.deadline_floor_s=8", "train.deadline_factor=4"]
    summary = run_train(target, data, str(tmp_path / "run"), load_config(None, settings), progress=False)
    assert summary["step"] == summary["total_steps"] == 8 and summary["restarts"] == 1, summary
    missed = summary["deadlines_missed"]
    assert [m["late"] for m in missed] == [["target 1"]] and "step 3" in missed[0]["what"], missed
    assert missed[0]["limit_s"] >= 8, missed  # the floor, and 4 x the steps' median on top
    assert "did not answer within" in summary["failures"][0], summary["failures"]
    rows = [json.loads(x) for x in storage.read_text(str(tmp_path / "run" / "metrics.jsonl")).splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert summary["restart_seconds"] and summary["restart_seconds"][0] > 0
