"""The held-out evaluation's order and pace, and every graph shape a run meets.

NCCL's watchdog counts a send from the moment it is posted. An evaluation that queued every held-out
batch at once had each target post all of its sends within seconds while the drafters, in
lock-step, took them one forward (and, on a shape's first use, one compile) at a time: the last
sends waited minutes, past `train.collective_timeout_s`. So an evaluation goes in waves no deeper
than training's in-flight window (`train.max_in_flight` + 1 batches a stream), the next wave's
sends posted only once the drafters took the last one's; and the held-out samples are batched in
order of length, so a wave meets few padded lengths. The run meets all of them, training's and
evaluation's, before step 0 (`warm_shapes`, `DrafterWorker.warm_up`). `evaluate` drives the waves
on the stream actors it is given; nothing here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_ray.train.schedule import Sample


def bucket(length: int, length_bucket: int) -> int:
    """A context's padded length (`drafter.forward.bucket_length`, without importing torch here)."""
    return -(-length // length_bucket) * length_bucket


@dataclass(frozen=True)
class Wave:
    """Batches evaluated together: (stream, batch) in the order each stream's target sends them,
    and which of them are counted (the rest fill the last round so every rank runs as many forwards)."""

    batches: list[tuple[int, list[Sample]]]
    counted: list[bool]


def batches_by_length(heldout: list[Sample], lengths: list[int] | None, batch_size: int) -> list[list[Sample]]:
    """The held-out samples in batches of `batch_size`, shortest first (stable: a fixed order for a
    fixed split), so a batch's samples pad little and consecutive batches share padded lengths."""
    order = sorted(range(len(heldout)), key=lambda i: lengths[i]) if lengths else list(range(len(heldout)))
    ordered = [heldout[i] for i in order]
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def waves(batches: list[list[Sample]], streams: int, depth: int) -> list[Wave]:
    """Batch i goes to stream i mod `streams`; each wave holds `depth` rounds (a batch per stream
    each). The last round is filled with repeats of the first batch, whose results are dropped:
    sharded weights are gathered collectively, so every rank runs as many forwards."""
    counted = len(batches)
    padded = batches + [batches[0]] * (-counted % streams) if batches else []
    per_wave = streams * max(1, depth)
    return [
        Wave(
            [(i % streams, padded[i]) for i in range(start, min(start + per_wave, len(padded)))],
            [i < counted for i in range(start, min(start + per_wave, len(padded)))],
        )
        for start in range(0, len(padded), per_wave)
    ]


def warm_shapes(
    train_lengths: list[int],
    heldout_batches: list[list[Sample]],
    heldout_lengths: dict[Sample, int],
    batch_size: int,
    length_bucket: int,
) -> list[tuple[int, int, bool]]:
    """Every (batch, padded length, grad mode) a run's drafter meets: training's batches are
    `batch_size` samples padded to a length bucket that some training sample reaches (the batch's
    longest), evaluation's are the held-out batches as `batches_by_length` makes them. Longest
    first: the step's peak memory is met at once, not hours in."""
    shapes = {(batch_size, bucket(n, length_bucket), True) for n in train_lengths}
    shapes |= {(len(b), bucket(max(heldout_lengths[s] for s in b), length_bucket), False) for b in heldout_batches}
    return sorted(shapes, key=lambda s: (-s[1], -s[0], not s[2]))


def evaluate(streams: Any, batches: list[list[Sample]], depth: int, step: int) -> list[float | None]:
    """Simulated tau of each drafter of `streams` (`Streams`) on the held-out `batches`, spread over
    every stream (a drafter's ranks hold the same weights, and each batch's anchors come from a fixed
    seed), in waves of `depth` batches a stream; each batch's features are computed once for all the
    drafters. With send/recv features no training batch is in flight now (`Feeder.horizon`)."""
    teams = streams.teams
    if not batches:
        return [None] * len(teams)
    taus: list[list[float]] = [[] for _ in teams]
    for k, wave in enumerate(waves(batches, streams.count, depth)):
        what = f"evaluation wave {k + 1} (step {step})"
        limit = streams.deadlines.limit(depth)
        if streams.cfg.train.colocate:
            drafters = [teams[0].drafters[s] for s, _ in wave.batches]
            refs = [d.evaluate_samples.remote(b) for d, (_, b) in zip(drafters, wave.batches)]
            per_team = [streams.wait(refs, drafters, what, limit)]
        else:
            targets = streams.targets
            if streams.direct:
                dsts = [[streams.layout.drafter(t, s) for t in range(len(teams))] for s in range(streams.count)]
                features = [targets[s].send_features.remote(b, dsts[s]) for s, b in wave.batches]
            else:
                features = [targets[s].features.remote(b) for s, b in wave.batches]
            actors = [team.drafters[s] for team in teams for s, _ in wave.batches]
            refs = [d.evaluate.remote(f) for d, f in zip(actors, features * len(teams))]
            got = streams.wait(refs, actors, what, limit, watch=features if streams.direct else None)
            per_team = [got[i * len(wave.batches) : (i + 1) * len(wave.batches)] for i in range(len(teams))]
        for i, results in enumerate(per_team):
            taus[i] += [t for part, counted in zip(results, wave.counted) if counted for t in part]
    return [sum(flat) / len(flat) if flat else None for flat in taus]
