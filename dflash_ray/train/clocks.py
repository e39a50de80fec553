"""The GPU run's durations on the CPU: what decides its first hours is time, which a tiny CPU run
does not have. With `train.clocks.scale` > 0 each stream actor waits as long as its GPU role would,
times the scale: a drafter's first use of a graph shape in a process costs a compile (on GPUs every
rank stalls for it together, since FSDP2's all-gathers keep the drafters in lock-step), a target's
forward and a drafter's step cost their time per token, and a feature send its transfer. NCCL's
watchdog (`p2p`'s, on the CPU) runs on the same clock: `train.collective_timeout_s` times the
scale. So the proportions of the real run (watchdog against compile against step) hold, and the
suite meets the watchdog, the compiles and the deadlines where the GPU run would. No Ray here.

The defaults are the Qwen3.6-27B preset's figures (bench/RESULTS.md): the H200's first compiled step
16.5 s (about 10 s a graph), the colocated step 0.369 s at 3,072 tokens, the target's capture of
3,072 tokens about 0.4 s (2 x 27B x 3,072 FLOPs at ~40% of 989 TFLOP/s), a 12K-token sample's
~630 MB of features over ~25 GB/s of PCIe about 0.006 s at 3,072 tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_ray.config import ClocksConfig

REFERENCE_TOKENS = 3072  # `ClocksConfig`'s per-token durations are given for a batch of this many tokens


@dataclass
class Clock:
    """One process's clock: the shapes it has compiled, and the waits it adds."""

    cfg: ClocksConfig
    compiled: set = field(default_factory=set)

    @property
    def on(self) -> bool:
        return self.cfg.scale > 0

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def watchdog_s(self, timeout_s: float) -> float:
        """NCCL's watchdog runs on the GPU's clock: `timeout_s` scaled with the rest. The CPU's own
        collectives (gloo) keep the unscaled timeout, since the CPU's real work is not scaled."""
        return timeout_s * self.cfg.scale if self.on else timeout_s

    def compile(self, shape: tuple) -> None:
        """A graph of `shape` is met: the first time in this process it costs a compile."""
        if self.on and shape not in self.compiled:
            self.compiled.add(shape)
            self._wait(self.cfg.compile_s * self.cfg.scale)

    def forward(self, tokens: int) -> None:
        self._wait(self.cfg.target_forward_s * self.cfg.scale * tokens / REFERENCE_TOKENS)

    def step(self, tokens: int) -> None:
        self._wait(self.cfg.drafter_step_s * self.cfg.scale * tokens / REFERENCE_TOKENS)

    def transfer(self, tokens: int) -> None:
        self._wait(self.cfg.transfer_s * self.cfg.scale * tokens / REFERENCE_TOKENS)
