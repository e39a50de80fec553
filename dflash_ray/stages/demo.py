"""`dflash-ray demo`: the whole pipeline on the embedded default, on one machine, local storage.

Stages: prompts (the bundled set of a few hundred varied prompts, bad records included) → a few
prompts kept aside for evaluation → generation by SmolLM2-135M-Instruct itself in vLLM generator
actors → Ray Data tokenization → validation gate → online training with 2 streams → export →
evaluation of the trained drafter on the kept-aside prompts (real speculative decoding). The demo
fails unless training raised the held-out simulated acceptance length over step 0's by
`pipeline.min_tau_gain` and the drafter beats n-gram prompt lookup on the same prompts (`pipeline.beat_ngram`).
`run_pipeline` runs the same stages on any config (`dflash-ray pipeline`).
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_ray.config import RunConfig, apply_override, config_from_dict, merge_settings, read_settings
from dflash_ray.errors import DFlashError
from dflash_ray.stages import Stage
from dflash_ray.stages.pipeline import run_pipeline
from dflash_ray.registry import SMOLLM2

SMALL_FILES = ("demo_chats.jsonl", "demo_sharegpt.jsonl", "demo_alpaca.jsonl")  # 48 prompts, 4 bad records
DEMO_FILES = SMALL_FILES + ("demo_mix.jsonl",)  # + code, math, explanations, chat, tool calls
# prompts of kinds none of those holds (rewriting, extraction, classification, a story, a riddle): never
# generated for, trained on or used to choose a setting; the summary's `unseen` figures are measured on them
UNSEEN_FILE = "demo_unseen.jsonl"

# The demo's settings under the user's config (their file and --set overrides win over these).
# Generation is greedy because evaluation is: the drafter learns the very outputs it is scored on.
# One generator with both cores: on 2 cores a second engine adds little (bench/RESULTS.md).
DEMO_SETTINGS = [
    f"prompts.tokenizer={SMOLLM2}",
    f"tokenize.tokenizer={SMOLLM2}",
    "generate.name=demo",
    "generate.generators=1",
    "generate.generator_cpus=2",
    "generate.shard_size=32",
    "generate.max_tokens=256",
    "generate.max_model_len=2048",
    "generate.truncated=keep",
    "generate.temperature=0",
    "train.num_streams=2",
    "train.actor_cpus=0.5",
    "train.epochs=5",
    "train.lr=3e-3",
    # bf16 matmuls, as on GPUs (fp32 master weights): where the CPU has them natively (AVX512-BF16,
    # AMX) a step takes 0.48 s against fp32's 0.76 (`bench.demo_step`; the vocabulary head is most
    # of it); elsewhere `demo_config` trains in fp32 (`native_bf16`). Evaluation stays fp32, where
    # speculative decoding is lossless token for token
    "train.dtype=bfloat16",
    "train.checkpoint_every=1000",
    # the target's outputs of the first epoch served again to the later ones (a few hundred MB a target)
    "train.feature_cache_gb=1",
    "train.heldout=8",
    "train.eval_every=20",
    # the drafter: DSpark (Markov head of rank 64) with two layers started from the target's last two,
    # scored at 256 new tokens. Of the three families at equal steps DSpark drafts best
    # (bench.families), and at 256 tokens, where prompt lookup is strongest, only the two-layer one
    # beats it. Its loss goes where greedy acceptance is decided (bench.first_position, each change
    # against the one before, on the demo's data, scored on every answer position of the kept-aside
    # and the unseen prompts): hard labels alone (the target's greedy tokens are the labels; the TV
    # term to its whole distribution is for sampled serving): kept-aside tau 1.39 -> 1.53; a block of
    # 4 with gamma 1 and 56 anchors (the same rows a step as 7 x 32): the first position 0.29 -> 0.37
    # kept aside, 0.17 -> 0.18 unseen (a block of 7 reached its fifth draft in about 1% of blocks).
    # Hard labels alone skip the target's distribution: a step 0.80 s -> 0.46 (`bench.demo_step`).
    "train.drafter=dspark",
    "train.block_size=4",
    "train.num_anchors=56",
    "train.loss_decay=1",
    "train.family.markov_rank=64",
    "train.family.ce_weight=1",
    "train.family.tv_weight=0",
    "train.num_layers=2",
    "evaluate.max_new_tokens=256",
    # greedy, as the demo generates: the sampled figure would decode every prompt a third time
    "evaluate.temperature=0",
    "pipeline.min_tau_gain=0.05",
    "pipeline.beat_ngram=true",
]
# The demo's earlier drafter (one-layer DFlash, block 16, scored at 64 new tokens), which vLLM on a CPU
# also serves: the benchmarks measured against it keep it (bench.distill, bench.families' start).
# `train.family={}`: DSpark's own settings (Markov rank, loss weights) mean nothing to DFlash
DFLASH_SETTINGS = [
    "train.drafter=dflash",
    "train.family={}",
    "train.block_size=16",
    "train.num_layers=1",
    "evaluate.max_new_tokens=64",
]


def bundled_inputs(small: bool = False) -> list[str]:
    """The bundled prompt files; `small`: only the 48-prompt set (quick tests)."""
    folder = resources.files("dflash_ray.assets")
    return [str(folder / name) for name in (SMALL_FILES if small else DEMO_FILES)]


def demo_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The demo's settings (training in fp32 on a CPU without native bf16: `native_bf16`), then the
    user's config file over them, then the user's overrides."""
    from dflash_ray.generation.cpu_engine import native_bf16  # on an AVX2-only EPYC a bf16 step took 35 s

    data: dict[str, Any] = {}
    for assignment in DEMO_SETTINGS:
        apply_override(data, assignment)
    if not native_bf16():
        apply_override(data, "train.dtype=float32")
    if path is not None and not path.strip():
        raise DFlashError("is empty (an unset variable?): give a config file, or leave --config out", field="--config")
    if path:
        data = merge_settings(data, read_settings(path))
    for assignment in overrides:
        apply_override(data, assignment)
    return config_from_dict(data)


def run_demo(workdir: str, cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    """The pipeline on the bundled prompts and SmolLM2, in `workdir`, training afresh each time
    (finished generation shards with the same settings are reused)."""
    import dataclasses

    work = str(Path(workdir).absolute())
    unseen = cfg.pipeline.unseen_prompts or [str(resources.files("dflash_ray.assets") / UNSEEN_FILE)]
    cfg = dataclasses.replace(
        cfg,
        pipeline=dataclasses.replace(
            cfg.pipeline, inputs=bundled_inputs(), workdir=work, target=SMOLLM2, unseen_prompts=unseen
        ),
    )
    try:
        return {**run_pipeline(cfg, progress=progress, fresh_training=True), "stage": "demo"}
    except DFlashError as e:
        e.summary["stage"] = "demo"
        raise


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="demo-run", metavar="DIR")


STAGES = (
    Stage(
        name="demo",
        help="run the pipeline on the embedded default",
        # the demo's settings under the user's own: the config is read again, not the one given
        command=lambda args, cfg: run_demo(
            args.workdir, demo_config(args.config, args.overrides), progress=not args.json
        ),
        arguments=_arguments,
        section="pipeline",
        order=99,
    ),
)
