"""Anchors as a function of the sample, the epoch and the seed: a run that lost a stream, stood in
for it and grew it back draws the anchors an undisturbed run draws, sample by sample."""

from __future__ import annotations

import io
import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_ray import storage
from dflash_ray.config import load_config
from dflash_ray.drafter.blocks import sample_anchors
from dflash_ray.tiny_models import tiny_qwen3
from dflash_ray.train.schedule import Drawn, Schedule, anchor_seed, passes, slots
from dflash_ray.train.shape import drafter_config
from dflash_ray.train.target_worker import TargetWorker
from dflash_ray.train.workers import ColocatedWorker, DrafterWorker

# fewer anchors than a sample's candidates, so that every draw matters
SETTINGS = [
    "train.num_layers=1",
    "train.target_layer_ids=[0,1,2]",
    "train.num_anchors=4",
    "train.batch_size=2",
    "train.length_bucket=8",
    "train.seed=7",
]
SAMPLES, STREAMS, PREFIX = 12, 3, 8  # 2 steps an epoch on 3 streams of 2; a sample named by its first ids


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("target"), num_layers=4, hidden_size=64, vocab_size=512)


@pytest.fixture(scope="module")
def part(tmp_path_factory):
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(18, 40, (SAMPLES,), generator=g).tolist()
    rows = [
        {"input_ids": torch.randint(1, 490, (n,), generator=g).tolist(), "loss_mask": [0] * 5 + [1] * (n - 5)}
        for n in lengths
    ]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    uri = str(tmp_path_factory.mktemp("data") / "part-0.parquet")
    storage.write_bytes(uri, buf.getvalue())
    return uri, {tuple(r["input_ids"][:PREFIX]): i for i, r in enumerate(rows)}


def _kept(mask: torch.Tensor, seeds: list[int], generator: torch.Generator | None = None) -> list[list[int]]:
    anchors, keep = sample_anchors(mask, 4, generator, seeds)
    return [a[k].tolist() for a, k in zip(anchors, keep)]


def test_anchors_of_a_row_depend_on_its_seed_alone():
    """Not on its batch-mates, their order, the padding or the draws made before; another epoch or
    another `train.seed` draws others."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(3, 60, generator=g) < 0.9).long()
    mask[1, 40:] = 0  # a shorter row, as padding makes it
    seeds = [anchor_seed(7, 0, i) for i in (4, 9, 2)]
    together = _kept(mask, seeds)
    alone = [_kept(mask[b : b + 1], seeds[b : b + 1])[0] for b in range(3)]
    reversed_ = _kept(mask.flip(0), seeds[::-1])[::-1]
    padded = _kept(torch.nn.functional.pad(mask, (0, 24)), seeds)
    advanced = torch.Generator().manual_seed(1)
    torch.randperm(100, generator=advanced)  # a generator with a history is not used where seeds are given
    after = _kept(mask, seeds, advanced)
    assert together == alone == reversed_ == padded == after
    assert all(len(row) == 4 for row in together)

    row = mask[:1]
    drawn = {(seed, epoch): _kept(row, [anchor_seed(seed, epoch, 4)])[0] for seed in (7, 8) for epoch in range(4)}
    assert len({tuple(a) for a in drawn.values()}) == len(drawn), drawn  # each epoch and seed its own


def test_anchor_seeds_come_with_the_schedules_samples_and_survive_pickling():
    """A step's samples carry their seed for the step's epoch: equal (and hashed) as their (uri, row)
    pairs, and pickled with it, as Ray sends them to a target."""
    samples = [("f", i) for i in range(SAMPLES)]
    schedule = Schedule(samples, STREAMS, 2, seed=7)
    epoch_of = {0: 0, 1: 0, 2: 1, 3: 1}
    for step, epoch in epoch_of.items():
        for stream in range(STREAMS):
            for drawn in schedule.batch_for(step, stream):
                assert drawn.anchor_seed == anchor_seed(7, epoch, samples.index(drawn))
    batch = schedule.batch_for(2, 1)
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch and [d.anchor_seed for d in back] == [d.anchor_seed for d in batch]
    assert hash(batch[0]) == hash(tuple(batch[0])) and json.loads(json.dumps(batch)) == [list(d) for d in batch]


def test_a_cached_batch_carries_the_anchor_seeds_of_the_epoch_it_is_taken_in(target, part):
    """The feature cache keeps what the target computed, never the seeds: a batch served again in
    a later epoch carries that epoch's; held-out samples (plain pairs) carry none."""
    uri, _ = part
    cfg = load_config(None, SETTINGS + ["train.feature_cache_gb=0.01"]).train
    worker = TargetWorker(target, [0, 1, 2], cfg)
    first, again = ([Drawn((uri, i), anchor_seed(7, epoch, i)) for i in (0, 3)] for epoch in (0, 1))
    computed = worker.features(first)
    served = worker.features(again)
    assert served["read_bytes"] == 0 and worker.cache.used > 0  # served from the cache
    assert computed["anchor_seed"].tolist() == [d.anchor_seed for d in first]
    assert served["anchor_seed"].tolist() == [d.anchor_seed for d in again]
    assert "anchor_seed" not in worker.features([tuple(s) for s in first[:2]])


class Recorder:
    """Every sample's anchors at every step, as the drafters of one run drew them (a sample drawn
    twice in a step, by a pass at zero weight, is recorded twice). `drop_seeds`: the batches lose
    their seeds, and anchors come from each rank's generator instead."""

    def __init__(self, names: dict[tuple[int, ...], int], drop_seeds: bool = False):
        self.names, self.drop_seeds = names, drop_seeds
        self.step = 0
        self.drawn: dict[tuple[int, int], list[list[int]]] = {}

    def watch(self, worker: DrafterWorker) -> DrafterWorker:
        forward = worker._forward

        def recorded(batch, generator, grad, **extra):
            if self.drop_seeds:
                batch = {k: v for k, v in batch.items() if k != "anchor_seed"}
            out = forward(batch, generator, grad, **extra)
            for ids, anchors, keep in zip(batch["input_ids"], out.blocks.anchors, out.blocks.keep):
                sample = self.names[tuple(ids[:PREFIX].tolist())]
                self.drawn.setdefault((self.step, sample), []).append(anchors[keep].tolist())
            return out

        worker._forward = recorded  # type: ignore[method-assign]
        return worker


def _calm(target, config, cfg, schedule, recorder: Recorder) -> None:
    """Three streams, object-store features: every step on all three."""
    features = TargetWorker(target, [0, 1, 2], cfg)
    ranks = [recorder.watch(DrafterWorker(target, config, "random", cfg, r, STREAMS)) for r in range(STREAMS)]
    for step in range(4):
        recorder.step = step
        for r, worker in enumerate(ranks):
            worker.train_step(step, features.features(schedule.batch_for(step, r)), point=schedule.point(step, 4))


def _elastic(target, config, cfg, schedule, recorder: Recorder) -> None:
    """Colocated streams: three at step 0, stream 2 lost for steps 1 and 2 (across the epoch's end:
    rank 0 takes its batches beside its own, rank 1 makes its pass again at zero weight), grown
    back at step 3 by a fresh rank."""
    ranks = [recorder.watch(ColocatedWorker(target, [0, 1, 2], config, "random", cfg, r, STREAMS)) for r in range(2)]
    lost = [recorder.watch(ColocatedWorker(target, [0, 1, 2], config, "random", cfg, 2, STREAMS))]
    grown = [recorder.watch(ColocatedWorker(target, [0, 1, 2], config, "random", cfg, 2, STREAMS))]
    for step, placed in ((0, ranks + lost), (1, ranks), (2, ranks), (3, ranks + grown)):
        recorder.step = step
        n = len(placed)
        for s, worker in enumerate(placed):
            micro = [schedule.batch_for(step, slot) for slot in slots(s, n, STREAMS)]
            worker.train_samples(step, micro, point=schedule.point(step, 4), passes=passes(n, STREAMS))


def test_an_elastic_run_draws_the_anchors_of_a_calm_run_sample_by_sample(target, part):
    """The bar: every sample, at every step, gets the anchors the undisturbed run gave it, whichever
    rank took it, after however many draws, and in a pass at zero weight alike. With the anchors of
    each rank's generator (the seeds dropped) the same two runs differ."""
    uri, names = part
    cfg = load_config(None, SETTINGS).train
    config = json.dumps(drafter_config(target, load_config(None, SETTINGS)))
    schedule = Schedule([(uri, i) for i in range(SAMPLES)], STREAMS, 2, seed=7)
    runs = {}
    for name, drop in (("calm", False), ("elastic", False), ("calm_rng", True), ("elastic_rng", True)):
        recorder = Recorder(names, drop)
        (_calm if name.startswith("calm") else _elastic)(target, config, cfg, schedule, recorder)
        runs[name] = recorder.drawn
    calm, elastic = runs["calm"], runs["elastic"]
    assert len(calm) == 2 * SAMPLES == len(elastic)  # each sample once an epoch, 2 epochs
    assert all(len(draws) == 1 for draws in calm.values())
    assert sum(len(draws) for draws in elastic.values()) == len(elastic) + 2 * 2  # rank 1's repeats
    for key, draws in elastic.items():
        assert all(d == calm[key][0] for d in draws), (key, draws, calm[key])
    assert {k: v[0] for k, v in runs["calm_rng"].items()} != {k: v[0] for k, v in runs["elastic_rng"].items()}


def test_anchor_seeds_travel_through_ray_to_the_target_and_by_send_and_recv_to_the_drafter(ray_cluster, target, part):
    """The samples keep their seeds as Ray passes them to a target actor; the seeds come back with
    the features (object store) and reach the drafter by send/recv (`handoff`) beside them."""
    import ray

    from conftest import joined_stream
    from dflash_ray.train import handoff

    uri, _ = part
    full = load_config(None, SETTINGS + ["train.num_streams=1"])
    drawn = Schedule([(uri, i) for i in range(SAMPLES)], 1, 2, seed=7).batch_for(7, 0)  # in epoch 1
    seeds = [d.anchor_seed for d in drawn]
    with joined_stream(target, full, "random") as (sender, receiver, layout):
        by_object = ray.get(sender.features.remote(drawn))
        meta = ray.get(sender.send_features.remote(drawn, [layout.drafter(0, 0)]))
        received = ray.get(receiver.__ray_call__.remote(lambda w, m: handoff.taken(m, w.source, w.place.device), meta))
    assert by_object["anchor_seed"].tolist() == seeds == received["anchor_seed"].tolist()
    assert received["anchor_seed"].dtype == torch.long and meta["meta"]["anchor_seed"] == ([2], "torch.int64")
