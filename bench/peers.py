"""Our trainer beside SpecForge's and vLLM speculators' on the same data, at equal steps, each arm
trained with several seeds and scored on the same 60 prompts, with a paired interval for every
comparison.

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
  speculators row's drafter of the same seed (`train.init_from`, `--trainers warm`, after
  `speculators`).

Seeds: every arm trains `--seeds` times, seeds 0..N-1 (ours: `train.seed`, which draws the start's
random weights, the sample order and the anchors; SpecForge's `seed`; speculators' `--seed`).

Scoring, teacher-forced (`dflash_ray.drafter.answer_scoring`): the fp32 target decodes each prompt
greedily once, as `evaluate` decodes its reference (`--max-new-tokens`, cut after a stop token), into
WORKDIR/peers-scoring/answers-SET.json, which every drafter, seed and later run reads; a drafter is
scored by one forward over each answer, and the blocks greedy speculative decoding would verify are
walked off it: the same committed tokens a block as real decoding (`teacher_forced`, tested against
it). Prompt lookup (n 2-4, as many drafts as the drafters) is scored on the same answers. The
prompt sets, none of them trained on (the bench refuses a set holding a training sample's prompt):

- `kept`: the demo's kept-aside prompts (`prompts-eval`, 12; kinds trained on, prompts not);
- `unseen`: the demo's prompts of unseen kinds (`prompts-unseen`, `demo_unseen.jsonl`, 8);
- `unseen_kinds`: `bench/unseen_kinds.jsonl` (8 more kinds: summary, correction, email, poem...);
- `copy`: 32 copy tasks (`bench.copy_prompts`: repeat, quote, number the sentences...) over the 16
  unseen prompts' own texts, so neither the task nor the text was trained on: 60 prompts in all.

The rule, stated before any run: a difference between two arms counts when its paired bootstrap 95%
interval (`intervals.paired_bootstrap`: prompts and seeds resampled together, 10,000 draws, both arms
on the same draws) excludes 1.0 for the ratio of tau (0 for the difference); otherwise it is within
the noise, whatever the point estimate says.

Printed: a row per arm (tau on each set over every block of every seed, the seeds' SD of tau, the
first draft position's acceptance, the median seconds a step, the training's wall seconds summed over
the seeds), prompt lookup's row, then for each pair (each of ours over each peer present, target
init over random init, each of ours over prompt lookup) and set the ratio of tau with its interval
and verdict; `--json` prints them as JSON lines, the intervals in the last. Each seed's folder keeps
`scores.json`: per set, each prompt's committed tokens and blocks and the counts by draft position.

    bash bench/peers_install.sh     # -> .peers-venv (SpecForge), .peers-venv-speculators (CPU torch)
    .venv/bin/python -m bench.peers --workdir /tmp/demo-run2 --quick [--json]   # the quick form
    .venv/bin/python -m bench.peers --workdir /tmp/demo-run2 [--json]           # the full bench

`--quick`: 150 steps (not 600), the `kept` and `unseen` sets (20 prompts), 3 seeds, the four arms at
equal steps (no `warm`). Its time, estimated (not run) from the step times measured at 600 steps:
ours 0.85 s a step on a quiet machine (2.08 on a busy one), so our two arms x 3 seeds x 150 steps
are about 13 minutes, plus about 40 s a training to start its actors and export (4 minutes), about 3
minutes to decode the 20 answers once (60 ms a token, one thread) and about 1 minute to score a
drafter (6 s for a 256-token answer, one thread): about 26 minutes for ours (44 at the busy
machine's step time). The peers at their measured 2.74 (SpecForge) and 3.09 s a step (speculators)
add about 24 and 26 minutes with their scoring and hidden-state files: `--quick` with both peers is
about 80 minutes, past 45 (`--quick --trainers specforge,target,random` about 52). The full bench
(600 steps, 60 prompts, 3 seeds, five arms) takes hours.

`--workdir` reuses a demo run's `tokenized`, `prompts-eval` and `prompts-unseen`; a folder without
them gets the demo's pipeline run up to the validation gate first (minutes: generation by the
target). Outputs go to `--out` (default WORKDIR/peers), one folder an arm and seed. `--steps 2
--seeds 1` is a smoke run; `--reuse` scores the drafters a run cut off in its scoring left there. On
a busy machine keep `--threads 1`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import random
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
EQUAL_STEPS = ("specforge", "speculators", "target", "random")  # `--quick`'s arms
OURS = ("target", "random", "warm")
PEERS = {"specforge": "SpecForge", "speculators": "speculators"}
STARTS = {"target": "target init", "random": "random init", "warm": "from speculators' drafter"}
SETS = ("kept", "unseen", "unseen_kinds", "copy")
QUICK_SETS = ("kept", "unseen")
STEPS, QUICK_STEPS = 600, 150
RESAMPLES = 10_000
RULE = "a difference counts when its paired bootstrap 95% interval excludes 1.0 (ratio) / 0 (difference)"
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


def prompt_sets(names: list[str], data: dict[str, str], scoring: Path, cfg) -> dict[str, str]:
    """Each scoring set's prompts dataset: the demo's two, and the bundled ones made here once."""
    from importlib import resources

    from bench.copy_prompts import TASKS, passages
    from bench.scaling import UNSEEN_MORE
    from dflash_ray.stages.demo import UNSEEN_FILE
    from dflash_ray.stages.prompts import run_prompts

    unseen_files = [str(resources.files("dflash_ray.assets") / UNSEEN_FILE), UNSEEN_MORE]
    out = {}
    for name in names:
        if name == "kept":
            out[name] = data["prompts-eval"]
        elif name == "unseen":
            out[name] = data["prompts-unseen"]
        elif name in ("unseen_kinds", "copy"):
            folder = scoring / f"prompts-{name.replace('_', '-')}"
            if not (folder / "_manifest.json").exists():
                source = UNSEEN_MORE
                if name == "copy":  # the unseen prompts' own texts: neither task nor text trained on
                    rng = random.Random(0)  # two distinct tasks a text (the prompts stage drops repeats)
                    texts = passages(unseen_files)
                    records = [
                        {"messages": [{"role": "user", "content": t.format(p=p)}]}
                        for p in texts
                        for t in rng.sample(TASKS, 2)
                    ]
                    source = str(scoring / "copy-prompts.jsonl")
                    Path(source).write_text("".join(json.dumps(r) + "\n" for r in records))
                run_prompts([source], str(folder), cfg, progress=False)
            out[name] = str(folder)
        else:
            raise SystemExit(f"--sets: {name!r} is none of {', '.join(SETS)}")
    return out


def training_prompts(tokenized: str) -> set[tuple[int, ...]]:
    """The prompt tokens of every training sample (its tokens before the first one trained on)."""
    from dflash_ray import manifest

    prompts = set()
    for row in manifest.read_rows(tokenized, ["input_ids", "loss_mask"], 10**9):
        mask = list(row["loss_mask"])
        prompts.add(tuple(row["input_ids"][: mask.index(1) if 1 in mask else len(mask)]))
    return prompts


class Scoring:
    """What scoring any drafter of the target needs, loaded once: the target in the evaluation's
    dtype, its embedding, head and stop tokens, each set's greedy answers (decoded once into
    `scoring`, read back by every later run) and their features by captured layers."""

    def __init__(self, sets: dict[str, str], cfg, scoring: Path, max_prompts: int, trained: set[tuple[int, ...]]):
        import torch

        from dflash_ray import hf_load
        from dflash_ray.drafter.acceptance import prompt_rows, within_context
        from dflash_ray.drafter.answer_scoring import cached_answers, greedy_answers
        from dflash_ray.registry import SMOLLM2, load_tokenizer, resolve, stop_token_ids
        from dflash_ray.target_model.capture import load_embed_and_head

        ecfg = cfg.evaluate
        self.dtype, self.max_new_tokens = getattr(torch, ecfg.dtype), ecfg.max_new_tokens
        self.ngram = (ecfg.ngram_min, ecfg.ngram_max)
        self.tokenizer = load_tokenizer(SMOLLM2)
        self.target = hf_load.causal_lm(resolve(SMOLLM2), dtype=self.dtype).eval()
        self.embed, self.head = (t.to(self.dtype) for t in load_embed_and_head(resolve(SMOLLM2)))
        self.eos = set(stop_token_ids(self.tokenizer))
        context = getattr(self.target.config.get_text_config(), "max_position_embeddings", None)
        self.answers, self.features, started = {}, {}, time.time()
        self.drafts = 0  # drafts a step of the drafter scored last: prompt lookup drafts as many
        for name, uri in sets.items():
            rows = prompt_rows(uri, max_prompts or 1_000_000)
            encoded, _ = within_context(rows, self.tokenizer, ecfg, context, uri)
            seen = [str(row["id"]) for row, ids in encoded if tuple(ids) in trained]
            if seen:
                raise SystemExit(f"--sets {name}: {len(seen)} prompts are training samples' prompts ({seen[:3]})")
            digest = hashlib.sha256(json.dumps([ids for _, ids in encoded]).encode()).hexdigest()
            key = {"target": SMOLLM2, "dtype": ecfg.dtype, "max_new_tokens": self.max_new_tokens, "prompts": digest}
            self.answers[name] = cached_answers(
                scoring / f"answers-{name}.json",
                key,
                lambda encoded=encoded: greedy_answers(self.target, encoded, self.max_new_tokens, self.eos),
            )
        self.answers_s = round(time.time() - started, 1)

    def drafter(self, folder: str) -> dict[str, dict[str, Any]]:
        """Per set, the drafter's `answer_scoring.record`."""
        from dflash_ray.drafter import families
        from dflash_ray.drafter.answer_scoring import answer_features, drafter_walks, record
        from dflash_ray.drafter.evaluation_models import check_same_target
        from dflash_ray.drafter.export import load_drafter

        drafter = load_drafter(folder).to(self.dtype).eval()
        check_same_target(drafter, self.target, self.target.config.get_text_config(), self.tokenizer, folder)
        self.drafts = drafter.cfg.block_size - families.get(drafter.cfg.family).first_prediction
        layers = list(drafter.cfg.target_layer_ids)
        out = {}
        for name, answers in self.answers.items():
            if (name, *layers) not in self.features:
                self.features[(name, *layers)] = answer_features(self.target, answers, layers)
            features = self.features[(name, *layers)]
            scored = drafter_walks(drafter, self.embed, self.head, features, answers, self.max_new_tokens, self.eos)
            out[name] = record(answers, scored)
        return out

    def lookup(self) -> dict[str, dict[str, Any]]:
        """Per set, prompt lookup's `record`, drafting as many tokens a step as the drafter scored last."""
        from dflash_ray.drafter.answer_scoring import lookup_walks, record

        return {name: record(a, lookup_walks(a, self.drafts, *self.ngram)) for name, a in self.answers.items()}


def reused(folder: Path, steps: int, seed: int) -> dict[str, Any] | None:
    """A trainer's finished record in `folder` (`--reuse`: a run cut off in its scoring)."""
    record = folder / "trained.json"
    if record.exists():
        trained = json.loads(record.read_text())
        if trained["steps"] == steps and trained.get("seed", 0) == seed:
            return trained
    return None


def train(trainer: str, seed: int, args, cfg, data: dict[str, str], out: Path, folder: Path) -> dict[str, Any]:
    """One trainer's drafter of one seed, trained and exported into `folder`, with its time figures."""
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.train.shape import drafter_config

    if trainer in PEERS:  # both train our drafter's config, on the target's layers it captures
        draft = drafter_config(SMOLLM2, cfg)
        layer_ids = draft["dflash_config"]["target_layer_ids"]
    if trainer == "specforge":
        hidden = peer_data.specforge_files(data["tokenized"], out / "hidden-states", layer_ids)
        return train_specforge(args, seed, folder, out / "hidden-states", draft, hidden)
    if trainer == "speculators":
        last = draft["num_target_layers"] - 1
        files = peer_data.speculators_files(data["tokenized"], out / "speculators-data", layer_ids, last)
        seeded = argparse.Namespace(**vars(args), seed=seed)
        return train_speculators(seeded, folder, out / "speculators-data", draft, files)
    if trainer in ("target", "random"):
        return train_ours(trainer, seed, cfg, data["tokenized"], folder, not args.json)
    if trainer == "warm":  # a team adapting a released drafter: the speculators row's, trained on by ours
        released = reused(out / "speculators" / f"seed-{seed}", args.steps, seed)
        if released is None:
            raise SystemExit("--trainers warm starts from the speculators row's drafter: run speculators first")
        return train_ours("target", seed, cfg, data["tokenized"], folder, not args.json, released["drafter"])
    raise SystemExit(f"--trainers: {trainer!r} is none of {', '.join(TRAINERS)}")


def train_specforge(
    args, seed: int, folder: Path, hidden: Path, draft_config: dict, files: dict[str, Any]
) -> dict[str, Any]:
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
            "seed": seed,
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


def train_ours(
    init: str, seed: int, cfg, tokenized: str, folder: Path, progress: bool, init_from: str = ""
) -> dict[str, Any]:
    """dflash-ray's training of `seed` from `init` (target | random) or from a released drafter's
    folder (`init_from`), then its export."""
    from dflash_ray import storage
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.export import run_export
    from dflash_ray.stages.pipeline import clear_training
    from dflash_ray.stages.train import run_train

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init=init, init_from=init_from, seed=seed))
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


def arm_row(name: str, scores: list[dict[str, dict]], trained: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's row: per set, tau over every block of every seed, the seeds' SD of tau (None with
    one seed) and the first draft position's acceptance; then its training figures over the seeds."""
    from dflash_ray.drafter.answer_scoring import counts, pooled_positions
    from dflash_ray.drafter.intervals import seed_sd

    row: dict[str, Any] = {"trainer": name, "seeds": len(scores)}
    for s in scores[0]:
        arm = counts([seed[s] for seed in scores])
        sd = seed_sd(arm)
        first = pooled_positions([seed[s] for seed in scores])[:1]
        row[f"tau_{s}"] = round(arm.tau, 4)
        row[f"sd_{s}"] = None if math.isnan(sd) else round(sd, 4)
        row[f"first_{s}"] = round(first[0][1] / first[0][0], 4) if first and first[0][0] else None
    if trained:
        row["steps"] = trained[0]["steps"]
        row["loss"] = round(statistics.fmean(t["loss"] for t in trained), 4)  # the seeds' mean
        row["step_s"] = round(statistics.median(t["step_s"] for t in trained), 3)
        row["train_s"] = round(sum(t["train_s"] for t in trained), 1)
        row["load_15min"] = trained[-1]["load_15min"]
        if "capture_s" in trained[0]:
            row["capture_s"] = trained[0]["capture_s"]
    return row


def intervals(scores: dict[str, list[dict[str, dict]]], seeds: int) -> dict[str, dict[str, Any]]:
    """For each pair (each of ours over each peer present, target over random init, each of ours
    over prompt lookup) and set: the ratio of tau and the difference, their paired bootstrap 95%
    intervals over prompts and seeds, and the verdict by the rule (`RULE`)."""
    from dflash_ray.drafter.answer_scoring import counts
    from dflash_ray.drafter.intervals import paired_bootstrap

    pairs = [(o, p) for p in PEERS for o in OURS if o in scores and p in scores]
    pairs += [("target", "random")] if "target" in scores and "random" in scores else []
    pairs += [(o, "lookup") for o in OURS if o in scores]
    out: dict[str, dict[str, Any]] = {}
    for ours, other in pairs:
        for s in scores[ours][0]:
            mine = counts([seed[s] for seed in scores[ours]])
            # prompt lookup is the same every seed: its counts stand beside each of ours
            theirs = counts([seed[s] for seed in scores[other]] * (seeds if other == "lookup" else 1))
            difference, ratio = paired_bootstrap(theirs, mine, num_resamples=RESAMPLES)
            verdict = "above" if ratio.low > 1 else "below" if ratio.high < 1 else "within noise"
            out[f"{ours}_over_{other}_{s}"] = {
                "ratio": round(ratio.estimate, 4),
                "low": round(ratio.low, 4),
                "high": round(ratio.high, 4),
                "difference": round(difference.estimate, 4),
                "difference_low": round(difference.low, 4),
                "difference_high": round(difference.high, 4),
                "verdict": verdict,
            }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="peers-run", help="a demo run's folder (its data reused), or a new one")
    parser.add_argument("--out", help="where the trainers write (default: WORKDIR/peers)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the small form: {QUICK_STEPS} steps, the sets {','.join(QUICK_SETS)}, the arms at equal steps "
        "(see the docstring for its time); any flag given still wins",
    )
    parser.add_argument("--seeds", type=int, default=3, help="trainings of each arm, seeds 0..N-1 (train.seed)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps of every trainer ({STEPS}; --quick {QUICK_STEPS})")
    parser.add_argument("--batch", type=int, default=2, help="samples a step, every trainer")
    parser.add_argument("--anchors", type=int, default=64, help="blocks a sample a step")
    parser.add_argument("--gamma", type=float, default=7.0, help="loss decay over a block's positions")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=float, default=0.04, help="share of the steps warming up")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="of each greedy answer scored")
    parser.add_argument(
        "--sets", help=f"prompt sets scored, of {', '.join(SETS)} (all; --quick {','.join(QUICK_SETS)})"
    )
    parser.add_argument("--max-prompts", type=int, default=0, help="the first N prompts of each set (0: all)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of SpecForge's training and of the scoring (our actors: one each); on a "
        "busy machine two threads wait on each other",
    )
    parser.add_argument("--reuse", action="store_true", help="score the drafters OUT already holds, untrained again")
    parser.add_argument(
        "--trainers",
        help=f"which of {', '.join(TRAINERS)} to run, in that order (all; --quick {','.join(EQUAL_STEPS)})",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    sets = (args.sets or ",".join(QUICK_SETS if args.quick else SETS)).split(",")
    trainers = (args.trainers or ",".join(EQUAL_STEPS if args.quick else TRAINERS)).split(",")
    if args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: train each arm at least once")

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
        scoring_dir = work / "peers-scoring"
        scoring_dir.mkdir(parents=True, exist_ok=True)
        uris = prompt_sets(sets, data, scoring_dir, cfg)
        # decoded before any training: a scoring that cannot run fails in minutes, not after hours
        scoring = Scoring(uris, cfg, scoring_dir, args.max_prompts, training_prompts(data["tokenized"]))
        scores: dict[str, list[dict[str, dict]]] = {}
        scoring_s = 0.0
        for trainer in trainers:
            arm = trainer if trainer in PEERS else f"dflash-ray-{trainer}"
            scores[trainer], records = [], []
            for seed in range(args.seeds):
                folder = out / arm / f"seed-{seed}"
                trained = reused(folder, args.steps, seed) if args.reuse else None
                if trained is None:
                    trained = {**train(trainer, seed, args, cfg, data, out, folder), "seed": seed}
                    (folder / "trained.json").write_text(json.dumps(trained))  # what `--reuse` reads
                began = time.time()
                scores[trainer].append(scoring.drafter(trained["drafter"]))
                scoring_s += time.time() - began
                (folder / "scores.json").write_text(json.dumps(scores[trainer][-1]))
                records.append(trained)
            show(arm_row(PEERS.get(trainer, f"dflash-ray ({STARTS.get(trainer, trainer)})"), scores[trainer], records))
        scores["lookup"] = [scoring.lookup()]
        (out / "prompt-lookup").mkdir(parents=True, exist_ok=True)
        (out / "prompt-lookup" / "scores.json").write_text(json.dumps(scores["lookup"][0]))
        lookup = arm_row("prompt lookup", scores["lookup"], [])  # the same every seed: no seeds, no SD
        show({k: v for k, v in lookup.items() if k != "seeds" and not k.startswith("sd_")})
        done: dict[str, Any] = {
            "steps": args.steps,
            "seeds": args.seeds,
            "samples_a_step": args.batch,
            "prompts": {name: len(a) for name, a in scoring.answers.items()},
            "answers_s": scoring.answers_s,  # decoding the answers (0 when read back from an earlier run)
            "scoring_s": round(scoring_s, 1),
            "seconds": round(time.time() - started, 1),
            "rule": RULE,
            "intervals": intervals(scores, args.seeds),
        }
        if args.json:
            show(done)
        else:
            show({k: v for k, v in done.items() if k != "intervals"})
            for pair, i in done["intervals"].items():
                print(f"{pair}: {i['ratio']} [{i['low']}, {i['high']}] {i['verdict']}", file=stdout, flush=True)


if __name__ == "__main__":
    main()
