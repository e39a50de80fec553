"""The sources of a prompts run and the records each gives, in the order they are read.

A source is a file, a folder of files, or a Hugging Face dataset split (`hf://datasets/...`). The
command line's inputs are sources that give all of their prompts; `prompts.sources` adds a mix:
a source with a `count` gives that many prompts (after quarantine and dedup), weighted sources
share `prompts.mix_total` by weight (largest remainders, so the shares add up to it exactly). A
counted or weighted source is read in a seeded shuffle (its files in a seeded order, its records
through a buffer of `prompts.shuffle_buffer`) and read no further once it has given its count: the
same seed and data give the same prompts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterator

from dflash_ray import manifest, storage
from dflash_ray.config import PromptsConfig
from dflash_ray.data import hub
from dflash_ray.data.records import COMPRESSIONS, SUFFIXES, RawRecord, iter_records


@dataclass
class Source:
    uri: str
    count: int | None = None  # prompts to give; None: all
    weight: float | None = None
    files: list[str] = field(default_factory=list)  # a file or folder source's files
    dataset: hub.HubDataset | None = None
    stream: Any = None  # the opened split of a dataset source
    revision: str | None = None  # the commit a dataset source is read at

    def open(self) -> None:
        """Find its files, or open its dataset split: a missing input fails before any is read."""
        if hub.is_hub_dataset(self.uri):
            self.dataset = hub.parse(self.uri)
            self.stream, self.revision = hub.open_dataset(self.dataset)
        else:
            self.files = manifest.dataset_files(self.uri, SUFFIXES)

    def name_of(self, item: RawRecord) -> str:
        """The prompt rows' `source`: the file's stem, or the dataset's ORG/NAME:SPLIT."""
        if self.dataset is not None:
            return self.dataset.name
        name = storage.basename(item.file)
        if name.lower().endswith(COMPRESSIONS):  # chat.jsonl.gz -> chat
            name = name.rsplit(".", 1)[0]
        return name.rsplit(".", 1)[0]

    def records(self, seed: int, buffer_size: int) -> Iterator[RawRecord]:
        if self.count == 0:  # a weight too small for a share of the total
            return iter(())
        rng = random.Random(f"{seed}:{self.uri}") if self.count is not None else None
        if self.dataset is not None:
            items = hub.iter_hub_records(self.dataset, self.stream)
        else:
            files = list(self.files)
            if rng is not None:
                rng.shuffle(files)
            items = (item for uri in files for item in iter_records(uri))
        return items if rng is None else shuffled(items, rng, buffer_size)

    def skipped(self) -> list[str]:
        """The files of a folder source without a manifest (the user's own) that are not read, so
        that none is passed over without a word."""
        if self.dataset is not None or self.files == [self.uri] or manifest.read_manifest(self.uri) is not None:
            return []
        return storage.skipped_files(self.uri, SUFFIXES)

    def entry(self) -> dict[str, Any]:
        """What the manifest records of it, before the figures of the run."""
        out: dict[str, Any] = {"uri": self.dataset.uri if self.dataset else self.uri}
        if self.revision:
            out["revision"] = self.revision
        if self.weight is not None:
            out["weight"] = self.weight
        out["requested"] = self.count  # None: all
        return out


def plan(inputs: list[str], pcfg: PromptsConfig) -> list[Source]:
    """The command line's inputs (all of each), then the mix's sources with their counts."""
    sources = [Source(uri) for uri in inputs]
    weights = [s.weight for s in pcfg.sources if s.weight is not None]
    shares = iter(apportion(pcfg.mix_total, weights))
    for s in pcfg.sources:
        count = next(shares) if s.weight is not None else s.count
        sources.append(Source(s.uri, count, s.weight))
    return sources


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights` into integers that add up to it: floors, then one more to the
    largest remainders (the earlier source on ties)."""
    if not weights:
        return []
    quotas = [total * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def shuffled(items: Iterator[Any], rng: random.Random, buffer_size: int) -> Iterator[Any]:
    """A seeded shuffle in bounded memory: a uniform permutation when the items fit the buffer."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        i = rng.randrange(buffer_size)
        yield buffer[i]
        buffer[i] = item
    rng.shuffle(buffer)
    yield from buffer
