"""`train`'s optimizer and schedule: the batches, epochs and steps (`train/schedule.py`: the
learning rate by samples seen), the anchors a sample trains on (`drafter/blocks.py`), AdamW's
settings (`train/gradients.py`, `train/workers.py`), the held-out evaluation's cadence
(`train/coordinator.py`) and what each step reports (`train/trackers.py`, `train/profile.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ray.errors import DFlashError
from dflash_ray.settings.fields import above, at_least, operational, within

TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    batch_size: int = at_least(1, default=1, most=1 << 16)  # sequences per stream per step
    # tokenized files whose samples shuffle together: a target reads each once an epoch
    shard_window: int = at_least(1, default=4)
    # samples of about one length that run together (balanced steps); None: num_streams x batch_size
    # (kept on a resume with other streams); 0: no balancing
    length_group: int | None = at_least(0, default=None)
    epochs: int = at_least(1, default=1)  # passes over the training samples
    max_steps: int = operational(at_least(0, default=0))  # 0: until the epochs are done
    num_anchors: int = at_least(1, default=64, most=1 << 20)  # blocks drafted and trained per sample a step
    lr: float = above(
        0, default=6e-4, most=10
    )  # AdamW's peak learning rate, after warm-up, decayed by cosine over the samples
    weight_decay: float = at_least(0, default=0.0)  # AdamW's decoupled weight decay
    warmup_ratio: float = within(0, 1, high_open=True, default=0.04)  # share of the samples the rate warms up over
    clip: float = above(0, default=1.0)  # the gradients' global norm is clipped to this
    seed: int = 0  # the drafter's random start, the shuffles and the held-out choice
    heldout: int = at_least(0, default=0)  # samples kept out of training (a seeded choice) for the held-out tau
    # steps between held-out evaluations (and one at the end); 0: never
    eval_every: int = operational(at_least(0, default=0))
    trackers: list = operational(
        default_factory=list
    )  # any of TRACKERS: the coordinator logs each step's metrics there
    # steps (1-based) traced with torch.profiler: Chrome traces of each drafter rank's step and its target's
    # forward under OUTPUT/profile/ (train/profile.py); open them in Perfetto
    profile_steps: list[int] = operational(default_factory=list)

    def check_reports(self) -> None:
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.profile_steps):
            raise DFlashError(
                f"{self.profile_steps!r}: allowed: a list of steps >= 1 (the metrics' step numbers)",
                field="train.profile_steps",
            )
        bad = [t for t in self.trackers if t not in TRACKERS]
        if bad or len(set(self.trackers)) < len(self.trackers):
            raise DFlashError(
                f"{self.trackers!r}: allowed: a list of distinct entries of {list(TRACKERS)}", field="train.trackers"
            )
