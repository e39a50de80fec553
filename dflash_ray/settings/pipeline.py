"""`pipeline` (stages/pipeline.py: every stage on one config, under one workdir) and `chaos`, its
fault drill (chaos.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_ray.errors import DFlashError
from dflash_ray.settings.data import check_uri
from dflash_ray.settings.fields import at_least


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    inputs: list = field(default_factory=list)  # raw dataset files or folders (URIs), hf://datasets/ORG/NAME:SPLIT
    workdir: str = ""  # every stage's output goes under this URI (file:// or s3://)
    target: str = ""  # target model: path, s3:// folder or short name
    eval_prompts: int = at_least(0, default=12)  # prompts kept out of generation and training, to measure tau on
    min_tau_gain: float = 0.0  # fail unless training raised the held-out simulated tau over step 0's by this
    beat_ngram: bool = False  # fail unless the trained drafter's tau beats the n-gram baseline's
    beat_ngram_unseen: bool = False  # the same on the `unseen_prompts`
    vllm_evaluate: bool = True  # also measure the exported drafter's acceptance in vLLM (when installed)
    # the inputs end with the target's own answers (existing responses): no generation, they are
    # tokenized as they are (`dflash-ray responses`); the kept-aside prompts are their contexts
    responses: bool = False
    # prompt files of kinds the inputs do not hold, never generated for nor trained on: the trained drafter
    # is also evaluated on them, so a headline does not rest on prompts from its own distribution alone
    unseen_prompts: list = field(default_factory=list)

    def check(self) -> None:
        bad = [x for x in self.inputs if not isinstance(x, str) or not x]
        if bad:
            raise DFlashError(f"{bad!r}: allowed: a list of file or folder URIs", field="pipeline.inputs")
        for i, uri in enumerate(self.inputs):
            check_uri(uri, f"pipeline.inputs[{i}]")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    """A fault drill (dflash_ray/chaos.py): the pipeline kills these while it runs, and must finish as
    an undisturbed run would."""

    faults: list = field(default_factory=list)  # one per entry: generator, tokenize, target, drafter or node,
    # alone or as KIND@SECONDS (its own window)
    seed: int = 0  # which victims, and when
    within_s: float = at_least(0, default=10.0)  # each fault fires within this many seconds after its victims show up

    def check(self) -> None:
        parse_faults(self)


# the chaos drill's faults (chaos.py fires them)
FAULT_KINDS = ("generator", "tokenize", "target", "drafter", "node")


def parse_faults(cfg: ChaosConfig) -> list[tuple[str, float]]:
    """(kind, window in seconds) of each `chaos.faults` entry; a bad one names the field."""
    faults = []
    for i, entry in enumerate(cfg.faults):
        kind, _, window = str(entry).partition("@")
        try:
            seconds = float(window) if window else cfg.within_s
        except ValueError:
            seconds = -1.0
        if kind not in FAULT_KINDS or not 0 <= seconds < float("inf"):  # nan and inf too: a fault that never fires
            raise DFlashError(
                f"{entry!r}: allowed: KIND or KIND@SECONDS, KIND one of {list(FAULT_KINDS)}", field=f"chaos.faults[{i}]"
            )
        faults.append((kind, seconds))
    return faults
