"""A long run's rate and size when its stream count changes: the learning rate follows the samples
behind a step, and streams lost to a node are stood in for by the placed ones (several batches a
step), so the steps and every sample's rate are those of a run that lost nothing."""

from __future__ import annotations

import io
import json
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_ray import storage
from dflash_ray.config import load_config
from dflash_ray.train.shape import drafter_config
from dflash_ray.tiny_models import tiny_qwen3
from dflash_ray.train.schedule import Schedule, passes, slots
from dflash_ray.train.target_worker import TargetWorker
from dflash_ray.train.workers import DrafterWorker, lr_at

# every valid anchor: the loss depends on no random draw, so two ways of taking one batch compare exactly
SETTINGS = ["train.num_layers=1", "train.target_layer_ids=[0,1,2]", "train.num_anchors=64", "train.lr=3e-3"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("target"), num_layers=4, hidden_size=64, vocab_size=512)


def _part(tmp_path, lengths: tuple[int, ...]) -> str:
    g = torch.Generator().manual_seed(5)
    rows = [
        {
            "id": f"r{i}",
            "source": "x",
            "input_ids": torch.randint(0, 490, (n,), generator=g).tolist(),
            "loss_mask": [0] * 7 + [1] * (n - 7),
            "seq_len": n,
            "truncated": False,
        }
        for i, n in enumerate(lengths)
    ]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    part = str(tmp_path / "part-0.parquet")
    storage.write_bytes(part, buf.getvalue())
    return part


def test_lr_by_samples_a_stream_standing_in_for_a_lost_one_steps_as_the_two_would(target, tmp_path):
    """One drafter taking a lost stream's batch beside its own (two passes) makes the step a drafter
    makes on the two together: the same loss, the same weights after it. A rank short of a batch
    makes its pass again at no weight (its collectives kept in step with the others')."""
    part = _part(tmp_path, (23, 40, 31))
    cfg = load_config(None, SETTINGS + ["train.batch_size=2"])
    config = json.dumps(drafter_config(target, cfg))
    one = load_config(None, SETTINGS).train
    feats = TargetWorker(target, [0, 1, 2], cfg.train)
    union = feats.features([(part, 0), (part, 1)])
    own, lost = feats.features([(part, 0)]), feats.features([(part, 1)])

    together = DrafterWorker(target, config, "random", cfg.train, 0, 1)
    standing_in = DrafterWorker(target, config, "random", one, 0, 1)
    point = (0, 2, 10)  # the first step of a run of 10 samples, 2 a step
    a = together.train_step(0, union, point=point)
    b = standing_in.train_step(0, own, lost, point=point, passes=2)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["lr"] == a["lr"] == lr_at(0, 10, 3e-3, 0.04, 2)
    assert b["tokens"] == own["loss_mask"].numel() + lost["loss_mask"].numel()
    _same_step(together, standing_in)

    alone, short = (DrafterWorker(target, config, "random", one, 0, 1) for _ in range(2))
    c = alone.train_step(0, own, point=point)
    d = short.train_step(0, own, point=point, passes=2)  # its second pass weighs nothing
    assert d["loss"] == pytest.approx(c["loss"], rel=1e-5) and d["tokens"] == c["tokens"]
    _same_step(alone, short)


def _same_step(a: DrafterWorker, b: DrafterWorker) -> None:
    """The same gradients (left in place by the step), and so the same weights after it (AdamW's
    first step moves each weight by about the rate, whatever its gradient's size: a gradient's last
    bits show at 1e-6 there)."""
    for p, q in zip(a.drafter.parameters(), b.drafter.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_lr_by_samples_slots_give_every_lost_streams_batch_to_a_placed_one():
    assert [slots(s, 3, 8) for s in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert passes(3, 8) == 3 and passes(8, 8) == 1 and passes(1, 2) == 2
    assert sorted(v for s in range(5) for v in slots(s, 5, 16)) == list(range(16))


def test_lr_by_samples_the_rate_goes_on_smoothly_across_a_resume_on_other_streams():
    """A run resumed on half its streams (`train.num_streams` changed: a step takes half the
    samples) goes on at the rate its samples have reached, that of the run had it gone on; by steps
    the rate would jump (x1.48 at the preset's length)."""
    samples = [("f", i) for i in range(4000)]
    eight = Schedule(samples, 8, 1, seed=0)
    total = eight.total_steps(1)
    at = total // 2
    four = Schedule(samples, 4, 1, seed=0, origin=(at, *eight.position(at)))
    four_total = four.total_steps(1)
    on_eight = lr_at(*_rate(eight.point(at, total)))  # had the run gone on with eight
    after = lr_at(*_rate(four.point(at, four_total)))
    by_steps = lr_at(at, four_total, 1.0, 0.04)
    assert eight.point(at, total)[0] == four.point(at, four_total)[0] == at * 8  # the samples behind it
    assert eight.seen(total) == four.seen(four_total) == len(samples)  # one epoch, whatever the streams
    assert after == pytest.approx(on_eight, abs=1e-9) and by_steps / on_eight > 1.3, (on_eight, after, by_steps)


def _rate(point: tuple[int, int, int]) -> tuple[int, int, float, float, int]:
    done, unit, total = point
    return done, total, 1.0, 0.04, unit


def test_grow_back_a_run_short_of_a_stream_takes_it_back_at_a_checkpoint_without_a_failure(ray_cluster, tmp_path):
    """The session's cluster has room for one stream of two while another job holds a CPU: the run
    starts on one (train.min_streams=1) taking a batch a step (train.lost_streams=shrink); the
    second stream's placement stays asked for, and once the CPU is freed the run grows back at its
    next checkpoint, to two batches a step. No restart is counted; every sample is taken once an
    epoch, but where the width changed at an odd place in an epoch, whose last sample then fills no
    step of two; every step's rate is the rate of the samples behind it in the epochs' order."""
    import ray

    from test_train import SETTINGS as TRAIN, _tokenized

    from dflash_ray.stages.train import run_train

    target = tiny_qwen3(tmp_path / "target", num_layers=4, hidden_size=64, vocab_size=512)
    g = torch.Generator().manual_seed(0)
    data = _tokenized(str(tmp_path / "data"), [torch.randint(0, 500, (48,), generator=g).tolist() for _ in range(16)])

    @ray.remote(num_cpus=1)
    class Holder:  # another job's work on the cluster
        def ready(self) -> bool:
            return True

    holder = Holder.remote()
    ray.get(holder.ready.remote())

    def release() -> None:  # once the run is seen on one stream (its rows, at its first checkpoint)
        while not list((tmp_path / "run" / "metrics").glob("*.jsonl")):
            time.sleep(0.2)
        ray.kill(holder)

    released = threading.Thread(target=release, daemon=True)
    released.start()
    # colocated streams of a CPU each: the room for one stream is the paired one's (two actors at 0.5)
    settings = ["train.colocate=true", "train.actor_cpus=1", "train.min_streams=1", "train.placement_timeout_s=3"]
    settings += ["train.epochs=12"]
    summary = run_train(target, data, str(tmp_path / "run"), load_config(None, TRAIN + settings), progress=False)
    released.join(timeout=1)
    assert summary["restarts"] == 0 and summary["failures"] == [], summary
    assert summary["grew_back"] and summary["grew_back"][0]["streams"] == summary["streams"] == 2, summary
    rows = [json.loads(x) for x in storage.read_text(str(tmp_path / "run" / "metrics.jsonl")).splitlines()]
    streams = [r["streams"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), streams
    assert streams[0] == 1 and streams[-1] == 2 and streams == sorted(streams), streams
    grown = streams.index(2)  # steps taken on one stream, 16 an epoch; then 8 an epoch
    epoch, offset = divmod(grown, 16)
    left_out = (16 - offset) % 2  # the grown epoch's last sample, where it fills no step of two
    taken = summary["samples"]
    assert taken["taken"] == sum(streams) == 16 * 12 - left_out and taken["distinct"] == taken["of"] == 16, taken
    assert taken["max_times"] == 12 and taken["min_times"] == 12 - left_out, taken

    def behind(step: int) -> int:  # the samples behind a step: where it stands in the epochs' order
        if step < grown:
            return step
        k, first = step - grown, (16 - offset) // 2
        return grown + 2 * k if k < first else 16 * (epoch + 1 + (k - first) // 8) + 2 * ((k - first) % 8)

    expected = [lr_at(behind(i), 16 * 12, 3e-3, 0.04, n) for i, n in enumerate(streams)]
    assert max(abs(r["lr"] - e) for r, e in zip(rows, expected)) < 1e-6
