"""The stages: every `dflash-ray` command is a `Stage` that its module declares.

A stage module holds its driver (`run_x`: a typed config in, a summary dict out) and, at its top
level, `STAGES`: the commands it serves. Nothing else lists them: the CLI's subcommands, the
`ray job submit` entry point (`jobs/run.py STAGE ...`) and the pipeline's order are derived from
`STAGES` here, so a stage module imports its heavy dependencies inside its functions.

Adding a stage (`stages/x.py` and its test; a config section of its own goes in `config.py`):
1. `run_x(...) -> dict`: the work, from the run config to a summary (`--json` prints it);
2. `STAGES = (Stage(name="x", help=..., arguments=..., command=...),)`: `arguments` adds its options
   to an argparse parser, `command(args, cfg)` calls `run_x`;
3. in `dflash-ray pipeline`: `inputs` and `outputs` (the folders under `pipeline.workdir` it reads
   and writes, which place it in the pipeline) and `step(run) -> dict | None` (its part of the
   pipeline's summary, None when the run's settings skip it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import pkgutil
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from dflash_ray.config import RunConfig

INPUTS_HELP = (
    "JSONL/JSON/Parquet files or folders, hf://datasets/ORG/NAME[/CONFIG][@REVISION][:SPLIT]; "
    "optional when the config has a mix (prompts.sources)"
)


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """A command whose settings all come from `--config` and `--set`."""


@dataclasses.dataclass
class PipelineRun:
    """One `dflash-ray pipeline` run as its stages see it: the config, where each output goes, the
    summary so far (each stage's `step` adds its part) and the seconds each stage took."""

    cfg: RunConfig
    progress: bool
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)  # what a stage hands a later one

    def at(self, folder: str) -> str:
        """`folder` under the workdir."""
        from dflash_ray import storage

        return storage.join(self.cfg.pipeline.workdir, folder)

    def timed(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, its seconds kept under `name` (the summary's `stage_seconds`)."""
        start = time.time()
        out = fn(*args, **kwargs)
        self.timings[name] = round(time.time() - start, 1)
        return out


@dataclasses.dataclass(frozen=True)
class Stage:
    """One command: its name and help line, the config section it reads, its arguments and its
    driver; where it runs in the pipeline, the workdir folders it reads and writes and its step."""

    name: str
    help: str
    command: Callable[[argparse.Namespace, RunConfig], dict[str, Any]]
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    section: str | None = None  # its section of the run config
    order: int = 100  # its place in `dflash-ray --help` (the pipeline's order where it has one)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    step: Callable[[PipelineRun], dict[str, Any] | None] | None = None


@functools.cache
def stages() -> tuple[Stage, ...]:
    """Every module's `STAGES`, in `order`; a name declared twice is an error of the package."""
    found: dict[str, Stage] = {}
    for module in pkgutil.iter_modules(__path__):
        for stage in getattr(importlib.import_module(f"{__name__}.{module.name}"), "STAGES", ()):
            if stage.name in found:
                raise RuntimeError(f"stage {stage.name!r} is declared twice (stages/{module.name}.py)")
            found[stage.name] = stage
    return tuple(sorted(found.values(), key=lambda s: (s.order, s.name)))


def get(name: str) -> Stage:
    for stage in stages():
        if stage.name == name:
            return stage
    raise KeyError(name)


def pipeline_stages() -> list[Stage]:
    """The stages with a pipeline step, each after every stage that writes a folder it reads (ties
    by `order`): the pipeline's order follows from what each stage reads and writes."""
    steps = [s for s in stages() if s.step is not None]
    writers = {folder: [s.name for s in steps if folder in s.outputs] for s in steps for folder in s.inputs}
    done: list[Stage] = []
    while len(done) < len(steps):
        ready = [
            s
            for s in steps
            if s not in done
            and all(w in {d.name for d in done} or w == s.name for f in s.inputs for w in writers.get(f, []))
        ]
        if not ready:
            raise RuntimeError(f"the pipeline's stages read in a cycle: {[s.name for s in steps if s not in done]}")
        done.append(ready[0])
    return done
