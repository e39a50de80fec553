"""Pretraining on raw text before distillation: does it raise acceptance at equal distillation steps?

The demo's pipeline up to the gate (its finished outputs in `--workdir` reused), then one drafter of
the demo's settings per arm, each distilled for the same `--steps` on the same samples and scored
by the same `evaluate` on the kept-aside prompts and on the unseen kinds, prompt lookup beside it:

- `none`: distillation alone, from the demo's start (the target's layers);
- `prompts`: `dflash-ray pretrain` first, on the prompts' text (the bundled and any self-written
  prompts, rendered with the chat template), then distillation from its export (`train.init_from`);
- `text`: pretrained on the prompts and the completions' text (prompt and answer as tokenized).

Printed, a row per arm: the pretraining's steps, tokens and seconds, then tau on the kept-aside
and the unseen prompts, lookup's on them, the first draft position and the training loss.

    .venv/bin/python -m bench.pretrain [--workdir DIR] [--steps 300] [--pretrain-steps 300] [--arms none,prompts,text]
        [--sets kept,unseen] [--reuse-data] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from dflash_ray import storage

ARMS = {"none": (), "prompts": ("prompts",), "text": ("prompts", "tokenized")}


SETS = {"kept": "prompts-eval", "unseen": "prompts-unseen"}


def score(run, drafter: str, references: dict, sets: list[str]) -> dict[str, Any]:
    """Tau on the kept-aside and (or) the unseen prompts, prompt lookup's beside it."""
    from dflash_ray.stages.evaluate import first_position, run_evaluate

    out: dict[str, Any] = {}
    for name in sets:
        folder = SETS[name]
        result = run_evaluate(
            drafter,
            run.cfg.pipeline.target,
            run.at(folder),
            run.cfg,
            sampled=False,
            reference_cache=references.setdefault(name, {}),
        )
        out[f"tau_{name}"] = result["tau"]
        out[f"tau_ngram_{name}"] = result["tau_ngram"]
        out[f"first_position_{name}"] = first_position(result["acceptance_by_position"])
        out[f"lossless_{name}"] = result["lossless"]
    return out


def one_arm(run, arm: str, pretrain_steps: int, references: dict, sets: list[str], progress: bool) -> dict[str, Any]:
    """Pretrain (where the arm does), distill for the run's steps, export and score."""
    from dflash_ray.stages.export import run_export
    from dflash_ray.stages.pipeline import clear_training
    from dflash_ray.stages.pretrain import run_pretrain
    from dflash_ray.stages.train import run_train

    cfg, folder = run.cfg, run.at(f"pretrain-bench/{arm}")
    row: dict[str, Any] = {"arm": arm}
    if ARMS[arm]:
        base = storage.join(folder, "pretrained")
        storage.delete_tree(base)
        pcfg = dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, steps=pretrain_steps))
        pre = run_pretrain(cfg.pipeline.target, [run.at(s) for s in ARMS[arm]], base, pcfg, progress=progress)
        row.update(
            pretrain_steps=pre["steps"],
            pretrain_tokens=pre["tokens_per_epoch"] or pre["tokens"],
            pretrain_epochs=pre["epochs"],
            pretrain_loss=pre["loss_end"],
            pretrain_s=pre["seconds"],
        )
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=base))
    clear_training(storage.join(folder, "train"), cfg)
    started = time.time()
    trained = run_train(cfg.pipeline.target, run.at("tokenized"), storage.join(folder, "train"), cfg, progress=progress)
    row.update(steps=trained["step"], train_loss=round(trained["loss"], 4), train_s=round(time.time() - started, 1))
    drafter = storage.join(folder, "drafter")
    storage.delete_tree(drafter)
    run_export(trained["checkpoint"], drafter, dtype="float32")
    row.update(score(run, drafter, references, sets))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="pretrain-run", help="work folder (a finished demo's outputs are reused)")
    parser.add_argument("--steps", type=int, default=300, help="distillation steps of every arm")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="pretraining steps of the arms that pretrain")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--sets", default="kept,unseen", help="prompt sets scored: kept (aside), unseen")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--reuse-data",
        action="store_true",
        help="read the workdir's prompts/, tokenized/ and prompt sets as they are (a finished demo's): no stage runs",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from pathlib import Path

    from bench.scaling import finished, prepare, steps_config
    from dflash_ray.cli import summary_stdout
    from dflash_ray.stages.demo import bundled_inputs

    arms, sets = args.arms.split(","), args.sets.split(",")
    unknown = [a for a in arms if a not in ARMS] + [s for s in sets if s not in SETS]
    if unknown:
        parser.error(f"unknown {unknown}; arms: {list(ARMS)}, sets: {list(SETS)}")
    work = str(Path(args.workdir).absolute())
    cfg = steps_config(
        work,
        args.steps,
        [
            f"pipeline.inputs=[{','.join(bundled_inputs())}]",
            # a pretraining step near a distillation step's cost: two sequences of 256 tokens
            "pretrain.batch_size=2",
            "pretrain.seq_len=256",
            *args.overrides,
        ],
    )
    if not cfg.pipeline.unseen_prompts:
        from importlib import resources

        from dflash_ray.stages.demo import UNSEEN_FILE

        unseen = str(resources.files("dflash_ray.assets") / UNSEEN_FILE)
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, unseen_prompts=[unseen]))
    started = time.time()
    storage.require_folder(work)
    rows = []
    with summary_stdout(args.json) as out:
        if args.reuse_data:
            needed = {folder for arm in arms for folder in ARMS[arm]} | {SETS[name] for name in sets} | {"tokenized"}
            run, _ = finished(cfg, not args.json, tuple(sorted(needed)))
        else:
            run, _ = prepare(cfg, progress=not args.json)
        references: dict = {}  # the target's own outputs, decoded once per prompt set
        for arm in arms:
            rows.append(one_arm(run, arm, args.pretrain_steps, references, sets, progress=not args.json))
            shown = json.dumps(rows[-1]) if args.json else "  ".join(f"{k}={v}" for k, v in rows[-1].items())
            print(shown, file=out, flush=True)
    base = next((r for r in rows if r["arm"] == "none"), None)
    done: dict[str, Any] = {"seconds": round(time.time() - started, 1)}
    if base is not None:
        for r in rows:
            if r is not base:
                for name in sets:
                    done[f"{r['arm']}_over_none_{name}"] = round(r[f"tau_{name}"] / base[f"tau_{name}"], 4)
    print(json.dumps(done) if args.json else "\n".join(f"{k}: {v}" for k, v in done.items()))


if __name__ == "__main__":
    main()
