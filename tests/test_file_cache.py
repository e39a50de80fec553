"""Reads that scale: over a dataset of 8 tokenized files, a target actor's reader (the worker's own,
`file_cache.FileCache`, fed the run's own `Schedule`) reads each file at most once per epoch per
stream; the order stays a seeded function of the step (an exact resume), every sample once an epoch."""

from __future__ import annotations

import collections
import pytest

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray.train import file_cache
from dflash_ray.train.schedule import Schedule, dataset_samples, sample_lengths

FILES, ROWS, STREAMS, EPOCHS = 8, 24, 2, 2


def _dataset(folder) -> str:
    folder.mkdir(exist_ok=True)
    for f in range(FILES):
        rows = [{"input_ids": [f, r] + [7] * (r % 5), "loss_mask": [0, 1] + [1] * (r % 5)} for r in range(ROWS)]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"part-{f:05d}.parquet")
    return str(folder)


def _reads_per_stream(samples, window: int) -> list[collections.Counter]:
    # as a run orders them: balanced by length (the lengths read from the files)
    schedule = Schedule(samples, STREAMS, 1, seed=3, window=window, lengths=sample_lengths(samples), group=STREAMS)
    counts = []
    for stream in range(STREAMS):
        reader = file_cache.FileCache(2 * max(window, 1))
        read = collections.Counter()
        real = reader.row

        def row(uri, r, reader=reader, read=read, real=real):
            before = reader.reads
            out = real(uri, r)
            read[uri] += reader.reads - before
            assert out["input_ids"][:2] == [int(uri[-13:-8]), r]  # the row asked for
            return out

        for step in range(schedule.total_steps(EPOCHS)):
            for uri, r in schedule.batch_for(step, stream):
                row(uri, r)
        counts.append(read)
    return counts


def test_each_file_is_read_at_most_once_per_epoch_per_stream(tmp_path):
    samples = dataset_samples(_dataset(tmp_path))
    for read in _reads_per_stream(samples, 4):
        assert len(read) == FILES and max(read.values()) <= EPOCHS, read
    # the whole-dataset permutation (window 0) with the same reader reads a file for most samples
    whole = _reads_per_stream(samples, 0)
    assert sum(whole[0].values()) > 5 * FILES * EPOCHS


def test_the_windowed_order_takes_every_sample_once_an_epoch_and_replays_exactly(tmp_path):
    samples = dataset_samples(_dataset(tmp_path))
    one = Schedule(samples, STREAMS, 1, seed=3, window=4)
    per_epoch = len(samples) // STREAMS
    taken = [s for step in range(per_epoch) for k in range(STREAMS) for s in one.batch_for(step, k)]
    assert sorted(taken) == sorted(samples)
    # a fresh schedule (a resume) gives the same batch at any step; another epoch another order
    again = Schedule(samples, STREAMS, 1, seed=3, window=4)
    assert [again.batch_for(s, 1) for s in (per_epoch + 5, 7, 0)] == [
        one.batch_for(s, 1) for s in (per_epoch + 5, 7, 0)
    ]
    assert one.order(0) != one.order(1)


def test_balanced_steps_give_the_streams_samples_of_one_length(tmp_path):
    """A long-tailed mix over 8 streams: the seeded order without balancing makes the step wait for a
    stream with several times the mean; balanced, every sample still once an epoch, the ratio near 1."""
    import torch

    g = torch.Generator().manual_seed(0)
    samples = [(f"f{i % 8}", i) for i in range(800)]
    lengths = (torch.empty(800).log_normal_(7.3, 0.9, generator=g).clamp(64, 12288)).long().tolist()
    plain = Schedule(samples, 8, 1, seed=1, window=4, lengths=lengths, group=0)
    balanced = Schedule(samples, 8, 1, seed=1, window=4, lengths=lengths, group=8)
    steps = range(plain.steps_per_epoch)
    assert plain.straggler_ratio(steps) > 2.0
    assert balanced.straggler_ratio(steps) <= 1.15
    taken = [s for step in steps for k in range(8) for s in balanced.batch_for(step, k)]
    assert sorted(taken) == sorted(samples)


@pytest.mark.slow
def test_plan_reports_the_straggler_ratio_of_a_dataset(tmp_path, capsys):
    import json

    from conftest import small_qwen3_config
    from dflash_ray.cli import main

    data = _dataset(tmp_path / "data")
    target = tmp_path / "config.json"  # a small target: the ratio is the schedule's, not the model's
    target.write_text(
        json.dumps(small_qwen3_config(head_dim=128).to_dict())  # Qwen3's own head_dim
    )
    assert (
        main(
            [
                "plan",
                "--json",
                "--set",
                f"plan.dataset={data}",
                "--set",
                f"plan.target_config={target}",
                "--set",
                "train.num_streams=2",
                "--set",
                "tokenize.max_seq_len=256",
                "--set",
                "generate.max_tokens=192",
                "--set",
                "train.length_bucket=32",
            ]
        )
        == 0
    )
    ratio = json.loads(capsys.readouterr().out)["training"]["straggler_ratio"]
    assert 1.0 <= ratio["balanced"] < ratio["unbalanced"]
