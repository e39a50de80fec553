"""`train`'s resilience: checkpoints (`train/checkpoint.py`), restarts and the deadlines that name a
stuck actor (`train/recovery.py`, `train/coordinator.py`, `progress.py`), collectives' timeouts
(`train/mesh.py`), the GPU's clocks replayed on the CPU (`train/clocks.py`) and the chaos tests'
injected faults (`train/workers.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ray.settings.fields import above, at_least, operational


@dataclass(frozen=True, kw_only=True, slots=True)
class ClocksConfig:
    """`train.clocks` (train/clocks.py): the GPU run's durations replayed on the CPU, each in the GPU's
    seconds times `scale`; 0 leaves the CPU's own. Per-token ones are for a batch of 3,072 tokens."""

    scale: float = at_least(0, default=0.0)
    compile_s: float = at_least(0, default=10.0)  # a drafter graph shape's first use in a process
    target_forward_s: float = at_least(0, default=0.4)  # a target forward of REFERENCE_TOKENS tokens
    drafter_step_s: float = at_least(0, default=0.37)  # a drafter's training step over as many
    transfer_s: float = at_least(0, default=0.006)  # sending as many tokens' features to a drafter


@dataclass(frozen=True, kw_only=True)
class Resilience:
    checkpoint_every: int = operational(at_least(1, default=50))
    # also a checkpoint once this many minutes passed since the last one (0: by steps only): a restart
    # redoes at most that much of the run's time
    checkpoint_every_minutes: float = operational(at_least(0, default=0.0))
    keep_checkpoints: int = operational(at_least(1, default=3))
    # actor deaths or step errors (an OOM on one rank) survived, each by a restart of every stream actor
    # from the last checkpoint, before failing
    max_restarts: int = operational(at_least(0, default=3))
    # a collective waiting longer for a rank raises instead of hanging
    collective_timeout_s: float = operational(above(0, default=300.0))
    # every wait of the coordinator (a step, an evaluation, start-up, a checkpoint) ends after
    # deadline_floor_s + deadline_factor x the median of the last steps' seconds; an actor that misses
    # it is named and the run restarts from its checkpoint (a rank stuck outside any collective)
    deadline_floor_s: float = operational(above(0, default=600.0))
    deadline_factor: float = operational(at_least(1, default=10.0))
    # the GPU run's durations on the CPU (train/clocks.py): compiles, forwards, steps, transfers
    clocks: ClocksConfig = operational(default_factory=ClocksConfig)
    # chaos testing: drafter rank 1 raises at this step (0: never), in a run's first attempt
    fault_step: int = operational(at_least(0, default=0))
    # chaos testing: target 1 blocks forever in its reader at this step (a stalled read), in a run's first attempt
    stall_step: int = operational(at_least(0, default=0))
