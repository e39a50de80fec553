"""`dflash-ray pretrain`: the drafter trained on raw text before distillation, from the target's
embedding and head alone; the target is never run.

Distillation needs the target's answers and its hidden states, the dearest data of a run; text is
free. Here the drafter of the run's `train` settings (family, shape, captured layers, start) learns
to draft the text's next tokens with the target's embedding of the context standing in for the
target's captured layers: the same embedding in each of the `num_target_features` slots its `fc`
reads, so the exported drafter has the run's own shape and `train --set train.init_from=OUT` starts
from it, where `fc` then meets the real layers. The step is training's own (`DrafterWorker.train_step`:
its loss, clipping, bf16 compute, warm-up and cosine schedule), over `pretrain.steps`.

It runs in this process on its device (the GPU when it sees one, as `evaluate` does): under
`ray job submit`, give the entry point a GPU (`--entrypoint-num-gpus 1`). It is cheap: one drafter,
no target forward. Its effect on acceptance: `bench/RESULTS.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from dflash_ray.config import RunConfig
from dflash_ray.stages import Stage

SUMMARY = "pretrain.json"  # beside the exported drafter: what it was pretrained on


def embedding_features(embed_VH, ids_BS, copies: int):
    """The stand-in for the target's captured layers: the context's embedding in each slot [B, S, copies·H]."""
    return embed_VH[ids_BS].repeat(1, 1, copies)


def _batch(worker, sequences: list[list[int]], copies: int) -> dict[str, Any]:
    """Sequences right-padded to the longest (loss mask 0 there), their features on the worker's device."""
    import torch

    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    features = embedding_features(worker.embed, ids.to(worker.embed.device), copies)
    return {"input_ids": ids, "loss_mask": mask, "features": features, "seconds": 0.0}


def _worker(target: str, cfg: RunConfig):
    """The run's drafter (its `train` settings and start) in a `DrafterWorker` stepping at the
    `pretrain` rate, and its shape's serving config."""
    from dflash_ray.train.shape import drafter_config, drafter_init
    from dflash_ray.train.workers import DrafterWorker

    p = cfg.pretrain
    serving = drafter_config(target, cfg)  # the run's drafter, checked against the target first
    tcfg = dataclasses.replace(
        cfg.train,
        lr=p.lr if p.lr is not None else cfg.train.lr,
        warmup_ratio=p.warmup_ratio if p.warmup_ratio is not None else cfg.train.warmup_ratio,
    )
    start = drafter_init(target, cfg, serving)
    worker = DrafterWorker(target, json.dumps(serving), start, tcfg, 0, 1)
    worker.set_total_steps(p.steps)
    return worker, start


def made_from(target: str, data: list[str], cfg: RunConfig) -> dict[str, Any]:
    """What a pretrained drafter is made from: the target, the text, the `pretrain` settings and the
    drafter's shape and start (`train`'s own); a rerun into its folder with others is refused."""
    from dflash_ray.settings.drafter_shape import DrafterShape

    shape = {f"train.{f.name}": getattr(cfg.train, f.name) for f in dataclasses.fields(DrafterShape)}
    settings = {f"pretrain.{k}": v for k, v in dataclasses.asdict(cfg.pretrain).items()}
    made = {"made_by": "pretrain", "target": target, "data": list(data), **shape, **settings}
    return json.loads(json.dumps(made, default=str))


def run_pretrain(
    target: str, data: list[str], out_dir: str, cfg: RunConfig, *, progress: bool = True, replace: bool = False
) -> dict[str, Any]:
    """Train the run's drafter on the text of `data` (see the module docstring) and export it to
    `out_dir`, the folder `train.init_from` takes (one pretrained from other settings or text there
    is replaced only with `replace`)."""
    from tqdm import tqdm

    from dflash_ray import storage
    from dflash_ray.data.pretrain_text import TextStream
    from dflash_ray.drafter.export import export_drafter
    from dflash_ray.drafter.export_folder import exporting
    from dflash_ray.registry import load_tokenizer, stop_token_ids

    p, started = cfg.pretrain, time.perf_counter()
    with exporting(out_dir, tuple(data), made_from(target, data, cfg), replace) as held:
        tokenizer = load_tokenizer(target)
        separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else stop_token_ids(tokenizer)[0]
        stream = TextStream(data, tokenizer, p.seq_len, separator, p.shuffle_window, p.seed)
        batch = stream.next_batch(p.batch_size)  # the text read (and refused, when it is none) before the drafter
        worker, start = _worker(target, cfg)
        copies = worker.drafter.cfg.num_features
        rows = []
        bar = tqdm(range(p.steps), desc="pretrain", unit="step", disable=not progress)
        for step in bar:
            batch = stream.next_batch(p.batch_size) if step else batch
            row = worker.train_step(step, _batch(worker, batch, copies))
            rows.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['tau']:.2f}")
        export_drafter(worker.drafter, out_dir, dtype="float32")  # a base to train on: full precision
        held.check()
        seconds = time.perf_counter() - started
        head, tail = rows[: min(10, len(rows))], rows[-min(10, len(rows)) :]
        summary = {
            "stage": "pretrain",
            "target": target,
            "data": data,
            "out_dir": out_dir,
            "family": worker.drafter.cfg.family,
            "start": start,
            "steps": p.steps,
            "sequences_per_step": p.batch_size,
            "seq_len": p.seq_len,
            "tokens": stream.tokens_read,
            "tokens_per_epoch": stream.epoch_tokens,  # None: the steps ended inside the first pass
            "epochs": round(stream.tokens_read / stream.epoch_tokens, 2) if stream.epoch_tokens else None,
            "loss_start": round(sum(r["loss"] for r in head) / len(head), 4),
            "loss_end": round(sum(r["loss"] for r in tail) / len(tail), 4),
            "tau_end": round(sum(r["tau"] for r in tail) / len(tail), 4),  # simulated, on the text it trains on
            "seconds": round(seconds, 1),
            "seconds_per_step": round(sum(r["drafter_seconds"] for r in rows) / len(rows), 4),
        }
        storage.write_text(storage.join(out_dir, SUMMARY), json.dumps(summary, indent=1))
    return summary


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument(
        "--data",
        required=True,
        action="append",
        metavar="URI",
        help="text to pretrain on (repeat for several): a dataset of this project (prompts, completions, "
        "tokenized) or files/folders of .txt, .md, .jsonl, .json or .parquet records (text or messages)",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="the exported drafter (for train.init_from)")
    p.add_argument(
        "--replace", action="store_true", help="replace a drafter pretrained there from other text or settings"
    )


STAGES = (
    Stage(
        name="pretrain",
        help="pretrain the run's drafter on raw text from the target's embedding and head (no target forward)",
        command=lambda args, cfg: run_pretrain(args.target, args.data, args.output, cfg, replace=args.replace),
        arguments=_arguments,
        section="pretrain",
        order=55,
    ),
)
