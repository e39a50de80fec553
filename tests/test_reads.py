"""Reads that scale: over a dataset of 8 tokenized files, a target actor's reader (the worker's own,
`reads.ShardReader`, fed the run's own `Schedule`) reads each file at most once per epoch per
stream; the order stays a seeded function of the step (an exact resume), every sample once an epoch."""

from __future__ import annotations

import collections

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray.train import reads
from dflash_ray.train.schedule import Schedule, dataset_samples

FILES, ROWS, STREAMS, EPOCHS = 8, 24, 2, 2


def _dataset(folder) -> str:
    for f in range(FILES):
        rows = [{"input_ids": [f, r, 7], "loss_mask": [0, 1, 1]} for r in range(ROWS)]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"part-{f:05d}.parquet")
    return str(folder)


def _reads_per_stream(samples, window: int) -> list[collections.Counter]:
    schedule = Schedule(samples, STREAMS, 1, seed=3, window=window)
    counts = []
    for stream in range(STREAMS):
        reader = reads.ShardReader(2 * max(window, 1))
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
    assert [again.batch_for(s, 1) for s in (per_epoch + 5, 7, 0)] == [one.batch_for(s, 1) for s in (per_epoch + 5, 7, 0)]
    assert one.order(0) != one.order(1)
