"""vLLM speculators' DFlash training, for `bench.peers`: its own `speculators train` on the files
`peer_data.speculators_files` wrote, through `bench/speculators_cpu.py` in its own virtualenv.

Its recipe set to the shared one where it has the setting: one layer, block 16, the same feature
layers and mask token, AdamW without weight decay, warm-up then cosine to zero, loss decay gamma,
gradients clipped to norm 1 (fixed in its trainer), bf16 autocast over fp32 weights. Where it has
none, the nearest: it packs whole samples into one sequence of `--total-seq-len` tokens a step (no
batch of samples; here the longest sample, so none is cut) with `--max-anchors` blocks over the
pack (here batch x anchors, the blocks the others train a step); its labels are the target's own
greedy tokens from its last layer (the others': the data's tokens, which a greedy regeneration
mostly equals); 1% of the samples go to the validation each epoch, which it always runs.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".peers-venv-speculators"


def command(args, draft: dict, data: Path, files: dict[str, Any], folder: Path) -> list[str]:
    from dflash_ray.registry import SMOLLM2, resolve

    dflash = draft["dflash_config"]
    return [
        # -P: not bench/ first on the path, where bench/tokenize.py would stand for the standard library's
        str(VENV / "bin" / "python"), "-P", str(ROOT / "bench" / "speculators_cpu.py"),
        "--speculator-type", "dflash", "--verifier-name-or-path", str(resolve(SMOLLM2)),
        "--num-layers", str(draft["num_hidden_layers"]), "--draft-arch", "qwen3",
        "--full-attention-indices", *map(str, range(draft["num_hidden_layers"])),
        "--block-size", str(draft["block_size"]), "--mask-token-id", str(dflash["mask_token_id"]),
        # its ids count the embedding as layer 0: our layer i's output is its i + 1
        "--target-layer-ids", *(str(i + 1) for i in dflash["target_layer_ids"]),
        # on a CPU: the dense SDPA mask (as our drafters there) and the loss without Triton
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--loss-fn", "ce", "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", str(args.gamma),
        "--optimizer", "adamw", "--lr", str(args.lr), "--weight-decay", "0",
        "--scheduler-type", "cosine", "--scheduler-warmup-ratio", str(args.warmup),
        "--data-path", str(data), "--hidden-states-backend", "file", "--on-missing", "raise",
        "--total-seq-len", str(files["longest"]), "--max-anchors", str(args.batch * args.anchors),
        "--train-data-ratio", "0.99", "--hidden-states-dtype", "bfloat16", "--num-workers", "0",
        "--max-steps", str(args.steps), "--log-freq", "1", "--seed", str(getattr(args, "seed", 0)), "--no-resume-from-checkpoint",
        "--save-path", str(folder / "out"), "--log-dir", str(folder / "logs"),
    ]  # fmt: skip


def train_speculators(args, folder: Path, data: Path, draft: dict, files: dict[str, Any]) -> dict[str, Any]:
    """Its training, and its last epoch's checkpoint (which `evaluate` reads as it is)."""
    if not (VENV / "bin" / "python").exists():
        raise SystemExit(f"{VENV} is missing: run `bash bench/peers_install.sh` first")
    metrics = folder / "metrics.jsonl"
    for made in ("out", "logs"):  # afresh: its trainer would resume from an earlier run's checkpoint
        shutil.rmtree(folder / made, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "METRICS_JSONL": str(metrics)}
    started = time.time()
    with (folder / "train.log").open("w") as sink:
        subprocess.run(command(args, draft, data, files, folder), env=env, stdout=sink, stderr=sink, check=True)
    train_s = time.time() - started
    steps = [m for m in map(json.loads, metrics.read_text().splitlines()) if "train" in m]
    if len(steps) != args.steps:
        raise SystemExit(f"speculators ran {len(steps)} steps, not {args.steps}: see {folder / 'train.log'}")
    epochs = sorted(int(p.name) for p in (folder / "out").iterdir() if p.name.isdigit())
    return {
        "drafter": str(folder / "out" / str(epochs[-1])),
        "steps": len(steps),
        # its loss is the decayed cross-entropy over the supervised positions (not over the weights)
        "loss": round(steps[-1]["train"]["loss"], 4),
        "step_s": round(statistics.median(m["profile"]["step_ms"] / 1000 for m in steps[2:] or steps), 3),
        "train_s": round(train_s, 1),
        "load_15min": round(os.getloadavg()[2], 1),
        "capture_s": files["seconds"],
    }
