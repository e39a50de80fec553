"""Our trainer beside SpecForge's and vLLM speculators' on the same data, at equal steps, scored by
the same evaluation.

One DFlash drafter shape (the demo's earlier one: one layer, block 16, the target's layers
1, 8, 14, 20, 27 captured, `train.shape.drafter_config`: SpecForge trains from that very config) and
one recipe (hard labels, `--anchors` blocks a sample, loss decay gamma `--gamma`, AdamW at `--lr`
with no weight decay, linear warm-up over `--warmup` of the steps then cosine to zero, gradients
clipped to norm 1, bf16 compute over fp32 weights, `--batch` samples a step, `--steps` steps) is
trained on the same tokenized samples by each of:

- SpecForge 0.2.0 (`specforge train`, offline mode, from the random start HF gives a fresh model),
  on hidden-state files written once by a Hugging Face forward of the bf16 target;
- speculators 0.9.0 (`speculators train`, offline, from its random start) on the same target's
  hidden states in its layout, the nearest recipe it has (`bench/peer_speculators.py` says where it
  differs: packed samples, the target's greedy labels);
- dflash-ray from the target's layers (`train.init=target`, our default start);
- dflash-ray from a random start (`train.init=random`, as SpecForge starts);
- and, not at equal steps but as a team adapting a released drafter would, dflash-ray from the
  speculators row's drafter (`train.init_from`, `--trainers warm`, after `speculators`).

Each drafter is scored by the same `dflash-ray evaluate` (real greedy speculative decoding, fp32,
`--max-new-tokens` new tokens) on the kept-aside prompts and on the prompts of unseen kinds, with
n-gram prompt lookup beside them. Printed: a row per trainer (tau on both sets, the first draft
position's acceptance, the median seconds a step, the training's wall seconds), then prompt lookup's
row and each of our drafters' tau over each peer's; `--json` prints the rows as JSON lines.

The peers live in their own virtualenv, installed once (never into .venv):

    bash bench/peers_install.sh     # -> .peers-venv (SpecForge), .peers-venv-speculators (CPU torch)
    .venv/bin/python -m bench.peers --workdir /tmp/demo-run2 [--steps 600] [--json]

`--workdir` reuses a demo run's `tokenized`, `prompts-eval` and `prompts-unseen`; a folder without
them gets the demo's pipeline run up to the validation gate first (minutes: generation by the
target). Outputs go to `--out` (default WORKDIR/peers). `--steps 5` is a smoke run; `--reuse`
scores the drafters a run cut off in its evaluation left there. On a busy machine keep `--threads 1`.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import peer_data
from bench.peer_speculators import train_speculators

ROOT = Path(__file__).resolve().parents[1]
PEERS_VENV = ROOT / ".peers-venv"
TRAINERS = ("specforge", "speculators", "target", "random", "warm")
PEERS = {"specforge": "SpecForge", "speculators": "speculators"}
STARTS = {"target": "target init", "random": "random init", "warm": "from speculators' drafter"}
STEP_LINE = re.compile(r"^step (\d+): (\{.*\})\s*$")  # SpecForge's log line a step (log_interval 1)


def settings(args) -> list[str]:
    """Our run's settings over the demo's (`bench.scaling.steps_config`): its earlier DFlash drafter,
    the recipe both trainers share, the demo's bundled prompts and unseen prompts for a new workdir."""
    from importlib import resources

    from dflash_ray.stages.demo import DFLASH_SETTINGS, UNSEEN_FILE, bundled_inputs

    streams = 2 if args.batch % 2 == 0 else 1  # the demo's two streams where the batch splits
    return [
        f"pipeline.inputs=[{','.join(bundled_inputs())}]",
        f"pipeline.unseen_prompts=[{resources.files('dflash_ray.assets') / UNSEEN_FILE}]",
        *DFLASH_SETTINGS,
        "train.target_layer_ids=[1,8,14,20,27]",
        f"train.num_anchors={args.anchors}",
        f"train.loss_decay={args.gamma}",
        f"train.lr={args.lr}",
        f"train.warmup_ratio={args.warmup}",
        "train.clip=1.0",
        "train.weight_decay=0",
        f"train.num_streams={streams}",
        f"train.batch_size={args.batch // streams}",
        "train.heldout=0",
        f"evaluate.max_new_tokens={args.max_new_tokens}",
        "evaluate.temperature=0",
    ]


def data_folders(work: Path, cfg, progress: bool) -> dict[str, str]:
    """The tokenized samples and both prompt sets: a finished demo run's, else made here by the
    demo's pipeline up to the validation gate."""
    wanted = ("tokenized", "prompts-eval", "prompts-unseen")
    if not all((work / name / "_manifest.json").exists() for name in wanted):
        from bench.scaling import prepare

        prepare(cfg, progress)
    return {name: str(work / name) for name in wanted}


def reused(folder: Path, steps: int) -> dict[str, Any] | None:
    """A trainer's finished record in `folder` (`--reuse`: a run cut off in its evaluation)."""
    record = folder / "trained.json"
    if record.exists() and json.loads(record.read_text())["steps"] == steps:
        return json.loads(record.read_text())
    return None


def train(trainer: str, args, cfg, data: dict[str, str], out: Path, folder: Path) -> dict[str, Any]:
    """One trainer's drafter, trained and exported into `folder`, with its time figures."""
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.train.shape import drafter_config

    if trainer in PEERS:  # both train our drafter's config, on the target's layers it captures
        draft = drafter_config(SMOLLM2, cfg)
        layer_ids = draft["dflash_config"]["target_layer_ids"]
    if trainer == "specforge":
        hidden = peer_data.specforge_files(data["tokenized"], out / "hidden-states", layer_ids)
        return train_specforge(args, folder, out / "hidden-states", draft, hidden)
    if trainer == "speculators":
        last = draft["num_target_layers"] - 1
        files = peer_data.speculators_files(data["tokenized"], out / "speculators-data", layer_ids, last)
        return train_speculators(args, folder, out / "speculators-data", draft, files)
    if trainer in ("target", "random"):
        return train_ours(trainer, cfg, data["tokenized"], folder, not args.json)
    if trainer == "warm":  # a team adapting a released drafter: the speculators row's, trained on by ours
        released = reused(out / "speculators", args.steps)
        if released is None:
            raise SystemExit("--trainers warm starts from the speculators row's drafter: run speculators first")
        return train_ours("target", cfg, data["tokenized"], folder, not args.json, init_from=released["drafter"])
    raise SystemExit(f"--trainers: {trainer!r} is none of {', '.join(TRAINERS)}")


def train_specforge(args, folder: Path, hidden: Path, draft_config: dict, files: dict[str, Any]) -> dict[str, Any]:
    """SpecForge's offline DFlash training on the files, then its HF export; its own step times."""
    import yaml

    from dflash_ray.registry import SMOLLM2, resolve

    specforge = PEERS_VENV / "bin" / "specforge"
    if not specforge.exists():
        raise SystemExit(f"{specforge} is missing: run `bash bench/peers_install.sh` first")
    for made in ("out", "drafter"):  # afresh: SpecForge would resume from an earlier run's checkpoint
        shutil.rmtree(folder / made, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "draft.json").write_text(json.dumps(draft_config, indent=1))
    run = {
        "model": {
            "target_model_path": str(resolve(SMOLLM2)),
            "draft_model_config": str(folder / "draft.json"),
            "mask_token_id": draft_config["dflash_config"]["mask_token_id"],
            "torch_dtype": "bfloat16",  # bf16 weights, fp32 master copies in its optimizer
        },
        "data": {"hidden_states_path": str(hidden), "max_length": 4096, "dataloader_num_workers": 0},
        "training": {
            "strategy": "dflash",
            "fsdp_sharding": "NO_SHARD",  # one process: DDP, which runs on the CPU (FSDP needs a GPU)
            "attention_backend": "sdpa",  # the dense mask, as our drafters use on the CPU
            "num_epochs": math.ceil(args.steps * args.batch / files["samples"]) + 1,
            "max_steps": args.steps,
            "batch_size": args.batch,
            "learning_rate": args.lr,
            "lr_scheduler": "cosine",
            "warmup_ratio": args.warmup,
            "max_grad_norm": 1.0,
            "num_anchors": args.anchors,
            "loss_decay_gamma": args.gamma,
            "loss_type": "dflash",
            "log_interval": 1,
            "save_interval": 0,
            "seed": 0,
        },
        "output_dir": str(folder / "out"),
        "run_id": "peers",
    }
    (folder / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))
    log = folder / "train.log"
    started = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}  # its torch's threads
    with log.open("w") as sink:
        subprocess.run(
            [str(specforge), "train", "-c", "run.yaml"], cwd=folder, env=env, stdout=sink, stderr=sink, check=True
        )
    train_s = time.time() - started
    steps = [
        (int(m.group(1)), ast.literal_eval(m.group(2))) for m in map(STEP_LINE.match, log.read_text().splitlines()) if m
    ]
    if not steps or steps[-1][0] != args.steps:
        raise SystemExit(f"SpecForge stopped before step {args.steps}: see {log}")
    drafter = folder / "drafter"
    with (folder / "export.log").open("w") as sink:
        subprocess.run(
            [str(specforge), "export", "--to", "hf", "--checkpoint", str(folder / "out" / "peers-latest"),
             "--draft-config", str(folder / "draft.json"), "--output-dir", str(drafter)],
            cwd=folder, stdout=sink, stderr=sink, check=True,
        )  # fmt: skip
    return {
        "drafter": str(drafter),
        "steps": steps[-1][0],
        "loss": round(steps[-1][1]["loss"], 4),
        "step_s": round(statistics.median(s["perf/optimizer_step_time_s"] for _, s in steps[2:] or steps), 3),
        "train_s": round(train_s, 1),
        "load_15min": round(os.getloadavg()[2], 1),  # the machine's load over the training (2 cores)
        "capture_s": files["seconds"],  # the hidden-state files, once before training (not in step_s)
    }


def train_ours(init: str, cfg, tokenized: str, folder: Path, progress: bool, init_from: str = "") -> dict[str, Any]:
    """dflash-ray's training from `init` (target | random) or from a released drafter's folder
    (`init_from`), then its export."""
    import dataclasses

    from dflash_ray import storage
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.export import run_export
    from dflash_ray.stages.pipeline import clear_training
    from dflash_ray.stages.train import run_train

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init=init, init_from=init_from))
    train = str(folder / "train")
    clear_training(train, cfg)
    started = time.time()
    trained = run_train(SMOLLM2, tokenized, train, cfg, progress=progress)
    train_s = time.time() - started
    run_export(trained["checkpoint"], str(folder / "drafter"), dtype="float32")
    metrics = [json.loads(x) for x in storage.read_text(storage.join(train, "metrics.jsonl")).splitlines()]
    return {
        "drafter": str(folder / "drafter"),
        "steps": trained["step"],
        "loss": round(trained["loss"], 4),
        "step_s": round(statistics.median(m["step_seconds"] for m in metrics[2:] or metrics), 3),
        "train_s": round(train_s, 1),
        "load_15min": round(os.getloadavg()[2], 1),  # the machine's load over the training (2 cores)
    }


def score(drafter: str, prompts: dict[str, str], cfg, references: dict[str, dict]) -> dict[str, Any]:
    """tau (and the first position's acceptance) on each prompt set by the same evaluation."""
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.evaluate import first_position, run_evaluate

    out: dict[str, Any] = {}
    for name, uri in prompts.items():
        result = run_evaluate(drafter, SMOLLM2, uri, cfg, sampled=False, reference_cache=references[name])
        out[f"tau_{name}"] = result["tau"]
        out[f"first_{name}"] = first_position(result["acceptance_by_position"])
        out[f"tau_ngram_{name}"] = result["tau_ngram"]
        out[f"lossless_{name}"] = result["lossless"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="peers-run", help="a demo run's folder (its data reused), or a new one")
    parser.add_argument("--out", help="where the trainers write (default: WORKDIR/peers)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of every trainer")
    parser.add_argument("--batch", type=int, default=2, help="samples a step, every trainer")
    parser.add_argument("--anchors", type=int, default=64, help="blocks a sample a step")
    parser.add_argument("--gamma", type=float, default=7.0, help="loss decay over a block's positions")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=float, default=0.04, help="share of the steps warming up")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of SpecForge's training and of the evaluation (our actors: one each); on a "
        "busy machine two threads wait on each other",
    )
    parser.add_argument("--reuse", action="store_true", help="score the drafters OUT already holds, untrained again")
    parser.add_argument(
        "--trainers", default=",".join(TRAINERS), help=f"which of {', '.join(TRAINERS)} to run, in that order"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from bench.scaling import steps_config
    from dflash_ray.cli import summary_stdout

    torch.set_num_threads(args.threads)
    # Ray starts its workers at nice 15: on a busy machine that alone slows our actors several times
    # against SpecForge's process (nice 0), so both run at 0
    os.environ.setdefault("RAY_worker_niceness", "0")
    work = Path(args.workdir).absolute()
    out = Path(args.out).absolute() if args.out else work / "peers"
    cfg = steps_config(str(work), args.steps, settings(args))
    started = time.time()
    with summary_stdout(args.json) as stdout:  # Ray's worker logs to stderr: stdout holds the rows alone

        def show(row: dict[str, Any]) -> None:
            print(
                json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), file=stdout, flush=True
            )

        data = data_folders(work, cfg, progress=not args.json)
        prompts = {"kept": data["prompts-eval"], "unseen": data["prompts-unseen"]}
        references: dict[str, dict] = {name: {} for name in prompts}  # the target's outputs, decoded once
        rows: dict[str, dict[str, Any]] = {}
        for trainer in args.trainers.split(","):
            folder = out / (trainer if trainer in PEERS else f"dflash-ray-{trainer}")
            trained = reused(folder, args.steps) if args.reuse else None
            if trained is None:
                trained = train(trainer, args, cfg, data, out, folder)
                (folder / "trained.json").write_text(json.dumps(trained))  # what `--reuse` reads
            name = PEERS.get(trainer, f"dflash-ray ({STARTS.get(trainer, trainer)})")
            scored = score(trained["drafter"], prompts, cfg, references)
            rows[trainer] = {"trainer": name, **{k: v for k, v in scored.items() if "ngram" not in k}, **trained}
            show(rows[trainer])
        lookup = {k.replace("_ngram", ""): v for k, v in scored.items() if "ngram" in k}
        show({"trainer": "prompt lookup", **lookup})
        done: dict[str, Any] = {
            "steps": args.steps,
            "samples_a_step": args.batch,
            "seconds": round(time.time() - started, 1),
        }
        for peer in (p for p in PEERS if p in rows):
            for trainer in (t for t in ("target", "random", "warm") if t in rows):
                for name in prompts:
                    ratio = rows[trainer][f"tau_{name}"] / rows[peer][f"tau_{name}"]
                    done[f"{trainer}_over_{peer}_{name}"] = round(ratio, 3)
        show(done)


if __name__ == "__main__":
    main()
