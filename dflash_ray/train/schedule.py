"""Which samples a run trains on and in what order: the dataset's samples, the held-out split (whole
prompts), and a seeded order per epoch split over the streams. A step's batch follows from the step
and the seed alone, so a resume replays exactly what an uninterrupted run does; so do the anchors
drawn on each of its samples (`anchor_seed`), whichever rank takes it and whatever it drew before.

The order shuffles within windows of files (`train.shard_window`): the files in a seeded order, taken
`window` at a time, each window's samples permuted together. A target actor keeps the files of the
window it is in (`file_cache.FileCache`), so it reads each file once per epoch, where a permutation
of the whole dataset would have it read a whole file for almost every sample.

Steps are balanced by length (`group`): each window's shuffled samples, cut into chunks of
RUNS_PER_CHUNK x `group`, each chunk sorted by length (stably), cut into runs of `group` and the runs
shuffled, so the streams of one step take samples of about one length and none waits long for
another's target (a step waits for its slowest stream, and a 12K-token sample costs the target
about 6x the mean)."""

from __future__ import annotations

import collections
import hashlib

from dflash_ray import storage
from dflash_ray.errors import DFlashError

RUNS_PER_CHUNK = 32  # runs of about one length shuffled together

Sample = tuple[str, int]  # (tokenized file URI, row in it)


def anchor_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of the anchors drawn on training sample `index` (its place in the run's training
    samples) in `epoch` of a run of `train.seed`: a function of those three alone, never of a rank's
    generator, so a run that lost streams, stood in for them and grew back draws the anchors an
    undisturbed run draws. 63 bits: an int64 tensor carries it from the target to the drafter."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Drawn(tuple[str, int]):
    """A training sample as a step takes it: the (uri, row) pair it equals and hashes as (so caches
    and ledgers keyed by samples see no difference), carrying its `anchor_seed` for the epoch, which
    travels with it to the target (`TargetWorker`) wherever Ray sends the batch."""

    anchor_seed: int

    def __new__(cls, sample: tuple[str, int], anchor_seed: int) -> Drawn:
        drawn = super().__new__(cls, sample)
        drawn.anchor_seed = anchor_seed
        return drawn

    def __reduce__(self):  # pickled with its seed (a tuple's own pickling would drop it)
        return Drawn, (tuple(self), self.anchor_seed)


class Schedule:
    """Which samples each stream trains on at each step: a seeded permutation per epoch.

    `origin` (step, epoch, offset): at `step` the run stands `offset` samples into `epoch`'s order;
    a run resumed on another number of streams goes on from where the checkpoint stood, every
    sample of the epoch still taken once. (0, 0, 0): a run's own start."""

    def __init__(
        self,
        samples: list[tuple[str, int]],
        num_streams: int,
        batch_size: int,
        seed: int,
        origin: tuple[int, int, int] = (0, 0, 0),
        window: int = 0,
        lengths: list[int] | None = None,
        group: int = 0,
    ):
        """`window`: files whose samples shuffle together (0: the whole dataset at once); `lengths`
        (one per sample) and `group`: samples of a length run together (0: no balancing)."""
        self.samples, self.streams, self.batch, self.seed = samples, num_streams, batch_size, seed
        self.window, self.lengths, self.group = window, lengths, group
        self.per_step = num_streams * batch_size
        self.steps_per_epoch = len(samples) // self.per_step
        if self.steps_per_epoch == 0:
            raise DFlashError(
                f"{len(samples)} samples are fewer than one step of {num_streams} streams x {batch_size} sequences"
            )
        self.origin = origin
        self._first = max(0, (len(samples) - origin[2]) // self.per_step)  # steps left in the origin's epoch
        self._epoch = -1
        self._order: list[int] | None = None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, offset into its order) at which `step` starts."""
        o_step, o_epoch, o_offset = self.origin
        k = step - o_step
        if k < self._first:
            return o_epoch, o_offset + k * self.per_step
        k -= self._first
        return o_epoch + 1 + k // self.steps_per_epoch, (k % self.steps_per_epoch) * self.per_step

    def seen(self, step: int) -> int:
        """Samples behind `step`: every epoch before its own counted whole, and its offset into its
        own. The same count whatever the number of streams that took the run there, so what follows
        it (the learning rate) goes on smoothly across a resume on another `train.num_streams`."""
        epoch, offset = self.position(step)
        return epoch * len(self.samples) + offset

    def point(self, step: int, total_steps: int) -> tuple[int, int, int]:
        """Where `step` stands in the run, in samples: (behind it, its own, the run's by `total_steps`)."""
        return self.seen(step), self.per_step, self.seen(total_steps)

    def total_steps(self, epochs: int) -> int:
        """The step at which `epochs` epochs are done."""
        o_step, o_epoch, _ = self.origin
        if o_epoch >= epochs:
            return o_step
        return o_step + self._first + (epochs - o_epoch - 1) * self.steps_per_epoch

    def batch_for(self, step: int, stream: int) -> list[Drawn]:
        """Stream `stream`'s samples at `step`, each with the seed of its anchors in the step's epoch."""
        epoch, offset = self.position(step)
        if epoch != self._epoch:
            self._order = self.order(epoch)
            self._epoch = epoch
        assert self._order is not None  # made above for the first epoch asked for
        start = offset + stream * self.batch
        return [
            Drawn(self.samples[j], anchor_seed(self.seed, epoch, j)) for j in self._order[start : start + self.batch]
        ]

    def order(self, epoch: int) -> list[int]:
        """The epoch's order of the samples (indices into `samples`)."""
        import torch

        generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        if not self.window:
            windows = [list(range(len(self.samples)))]
        else:
            by_file: dict[str, list[int]] = {}
            for i, (uri, _) in enumerate(self.samples):
                by_file.setdefault(uri, []).append(i)
            files = list(by_file)
            files = [files[j] for j in torch.randperm(len(files), generator=generator).tolist()]
            windows = [
                [i for uri in files[start : start + self.window] for i in by_file[uri]]
                for start in range(0, len(files), self.window)
            ]
        windows = [
            [members[j] for j in torch.randperm(len(members), generator=generator).tolist()] for members in windows
        ]
        lengths = self.lengths
        if lengths is None or self.group <= 1:
            return [i for members in windows for i in members]
        order: list[int] = []
        carry: list[int] = []
        for w, members in enumerate(windows):
            # whole runs only: the few samples past the last one join the next window's, so runs stay
            # aligned to the steps and within two windows of files
            members = carry + members
            whole = len(members) if w == len(windows) - 1 else len(members) - len(members) % self.group
            members, carry = members[:whole], members[whole:]
            size = self.group * RUNS_PER_CHUNK
            for start in range(0, len(members), size):
                chunk = sorted(members[start : start + size], key=lambda i: lengths[i])
                runs = [chunk[k : k + self.group] for k in range(0, len(chunk), self.group)]
                order += [i for j in torch.randperm(len(runs), generator=generator).tolist() for i in runs[j]]
        return order

    def straggler_ratio(self, steps: range) -> float:
        """Mean over `steps` of the longest stream's tokens over the mean stream's (1: balanced)."""
        length = dict(zip(self.samples, self.lengths or [0] * len(self.samples)))
        ratios = []
        for step in steps:  # a stream's batch is padded to its longest sample
            tokens = [
                max((length[s] for s in self.batch_for(step, k)), default=0) * self.batch for k in range(self.streams)
            ]
            ratios.append(max(tokens) / max(1e-9, sum(tokens) / len(tokens)))
        return sum(ratios) / max(1, len(ratios))


def slots(stream: int, placed: int, wanted: int) -> list[int]:
    """The schedule's streams (of `wanted`: `train.num_streams`) that placed stream `stream` (of
    `placed`) takes at each step: its own, and those of the streams lost, shared round the placed
    ones. So a run short of streams keeps its global batch and its steps, and with them every
    sample's step and learning rate (`gradients.accumulated`)."""
    return list(range(stream, wanted, placed))


def passes(placed: int, wanted: int) -> int:
    """Forward and backward passes every drafter rank makes a step (the most slots a placed stream takes)."""
    return -(-wanted // placed)


def dataset_samples(data: str) -> list[tuple[str, int]]:
    """(file, row) of every sample of a tokenized dataset in any layout `open_tokenized` reads."""
    from dflash_ray.data.tokenized import open_tokenized

    dataset = open_tokenized(data)
    return [(uri, r) for uri, n in zip(dataset.files, dataset.row_counts()) for r in range(n)]


def length_group(train) -> int:
    """The run of one length that balances a step (`train.length_group`; None: one step's samples)."""
    return train.length_group if train.length_group is not None else train.num_streams * train.batch_size


def sample_lengths(samples: list[tuple[str, int]]) -> list[int]:
    """Each sample's token count (the tokenized `seq_len` column, else its `input_ids` lengths)."""
    import pyarrow.compute as pc

    from dflash_ray.data.tokenized import _schema, read_table

    lengths: dict[str, list[int]] = {}
    for uri in dict.fromkeys(uri for uri, _ in samples):
        if "seq_len" in _schema(uri).names:
            lengths[uri] = read_table(uri, ["seq_len"]).column("seq_len").to_pylist()
        else:
            lengths[uri] = pc.list_value_length(read_table(uri, ["input_ids"]).column("input_ids")).to_pylist()
    return [int(lengths[uri][row]) for uri, row in samples]


def sample_prompts(samples: list[tuple[str, int]]) -> list[str]:
    """The prompt each sample answers (several completions of one prompt share it)."""
    from dflash_ray.arrow_files import read_parquet
    from dflash_ray.generation.completions import prompt_of

    ids: dict[str, list] = {}
    for uri in dict.fromkeys(uri for uri, _ in samples):
        fs, path = storage.arrow_filesystem(uri)
        ids[uri] = read_parquet(path, uri, filesystem=fs, columns=["id"]).column("id").to_pylist()
    return [prompt_of(str(ids[uri][row])) for uri, row in samples]


def split_heldout(samples: list, count: int, seed: int, prompts: list[str] | None = None) -> tuple[list, list]:
    """A seeded choice of at least `count` held-out samples, and the rest (both in dataset order).

    With `prompts`, whole prompts are held out: no completion of a held-out prompt is trained on.
    """
    import torch

    if count <= 0:
        return [], samples
    prompts = prompts or [str(i) for i in range(len(samples))]
    sizes = collections.Counter(prompts)
    unique = list(sizes)
    chosen: set[str] = set()
    held = 0
    for i in torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed + 104729)).tolist():
        if held >= count:
            break
        chosen.add(unique[i])
        held += sizes[unique[i]]
    if held >= len(samples):
        raise DFlashError(f"{count} leaves no training sample out of {len(samples)}", field="train.heldout")
    return (
        [s for s, p in zip(samples, prompts) if p in chosen],
        [s for s, p in zip(samples, prompts) if p not in chosen],
    )


class RunSamples:
    """A run's samples: the held-out split (whole prompts), the training samples' lengths (for
    balanced steps) and their balancing's run length, and the schedule over any number of streams."""

    def __init__(self, data: str, tcfg):
        from dflash_ray import manifest

        samples = dataset_samples(data)
        self.fingerprint = manifest.fingerprint(data)  # a resume continues on the same data, not the same path
        prompts = sample_prompts(samples) if tcfg.heldout > 0 else None
        self.heldout, self.train = split_heldout(samples, tcfg.heldout, tcfg.seed, prompts)
        self.lengths = sample_lengths(self.train) if tcfg.length_group != 0 else None
        # the balancing's run length, kept by resumes on another number of streams (the same order)
        self.group = length_group(tcfg)
        self.tcfg = tcfg

    def train_lengths(self) -> list[int]:
        return self.lengths if self.lengths is not None else sample_lengths(self.train)

    def schedule(self, streams: int, origin: tuple[int, int, int]) -> tuple[Schedule, int]:
        """The schedule from `origin` (`Schedule`: the start, or where a checkpoint made on another
        number of streams stood) and the step the run ends at."""
        tcfg = self.tcfg
        schedule = Schedule(
            self.train, streams, tcfg.batch_size, tcfg.seed, origin, tcfg.shard_window, self.lengths, self.group
        )
        total = schedule.total_steps(tcfg.epochs)
        return schedule, min(total, tcfg.max_steps) if tcfg.max_steps else total
