"""The first draft position's suspects side by side: several drafter recipes trained on the same
batches of one target worker, each scored on the target's own greedy answers to prompts of kinds
none of the training samples holds, and to the kept-aside prompts, with n-gram prompt lookup scored
the same way on the first recipe's blocks.

Every recipe is the demo's with one setting changed (`--variant NAME:KEY=VALUE[,KEY=VALUE]`; `init`
is the start, `train.*` any training setting, the drafter's shape included). Each trains for
`--steps` optimizer steps on two samples a step, in one process, with the production `train_step`.
Scoring is teacher-forced: the target decodes every scoring prompt once, greedily (what greedy
speculative decoding outputs, token for token); a block anchored at every response position is
drafted, and a draft position counts as accepted when it and every one before it equal the target's
tokens. So the figures are what real greedy decoding would accept from blocks started anywhere in
the answer (real decoding starts them where the previous block ended), at a fraction of its cost.

    .venv/bin/python -m bench.first_position --data demo-run/tokenized --eval demo-run/prompts-eval \\
        --unseen demo-run/prompts-unseen --workdir /tmp/fp --steps 400 \\
        --variant base: --variant lr1e-3:train.lr=1e-3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = 256


def greedy_answers(
    prompts: str, path: Path, target_dir: str, tokenizer, max_new_tokens: int = MAX_NEW_TOKENS
) -> list[dict[str, Any]]:
    """The target's greedy answer to each prompt (kept in `path`: decoding them is minutes)."""
    if path.exists():
        return json.loads(path.read_text())
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_ray.drafter.speculative import target_decode
    from dflash_ray.registry import stop_token_ids

    files = sorted(str(p) for p in Path(prompts).glob("*.parquet"))
    rows = pq.read_table(files).to_pylist()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = set(stop_token_ids(tokenizer))  # as the evaluation stops an answer
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        gen = target_decode(target, ids, max_new_tokens, eos)
        out.append({"id": row["id"], "source": row["source"], "prompt": ids, "answer": gen.token_ids})
    path.write_text(json.dumps(out))
    return out


def answers_file(answers: list[dict[str, Any]], path: Path) -> list[tuple[str, int]]:
    """The answers as a tokenized file (prompt unmasked, answer masked in), one sample a row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_ray.data.masking import replay

    samples = [replay(a["prompt"], a["answer"]) for a in answers]
    table = pa.table(
        {
            "id": [a["id"] for a in answers],
            "source": [a["source"] for a in answers],
            "input_ids": pa.array([s.input_ids.tolist() for s in samples], pa.list_(pa.int32())),
            "loss_mask": pa.array([s.loss_mask.tolist() for s in samples], pa.list_(pa.int8())),
            "seq_len": pa.array([len(s.input_ids) for s in samples], pa.int32()),
            "truncated": [False] * len(samples),
        }
    )
    pq.write_table(table, path)
    return [(str(path), i) for i in range(len(samples))]


def score(worker, batches: list[dict[str, Any]], ngram: tuple[int, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Teacher-forced acceptance of blocks anchored at every answer position (`teacher_forced`): by
    position (given the earlier ones), the first position's, and the mean acceptance length; and
    prompt lookup's on the same blocks (`ngram`: its shortest and longest n)."""
    from dflash_ray.drafter.ngram import accepted_at
    from dflash_ray.drafter.teacher_forced import blocks_accepted

    blocks, lookup = [], []
    for batch in batches:
        feats, ids, mask = batch["features"].float(), batch["input_ids"], batch["loss_mask"]
        mine = blocks_accepted(worker.drafter, worker.embed.float(), worker.head.float(), feats, ids, mask)
        tokens = ids[0].tolist()  # one sample a batch
        lookup += [(a, d, accepted_at(tokens, a, d, *ngram)) for a, d, _ in mine]
        blocks += mine
    return figures(blocks), figures(lookup)


def figures(blocks: list[tuple[int, int, int]]) -> dict[str, Any]:
    from dflash_ray.drafter.speculative import acceptance_by_position

    rates = acceptance_by_position([(drafted, accepted) for _, drafted, accepted in blocks])
    tau = statistics.fmean(accepted + 1 for _, _, accepted in blocks)
    return {"tau": round(tau, 4), "first_position": rates[0], "by_position": rates, "blocks": len(blocks)}


def variant(spec: str) -> tuple[str, list[str], str]:
    name, _, rest = spec.partition(":")
    overrides = [s for s in re.split(r",(?=[\w.]+=)", rest) if s]  # a list value keeps its commas
    init = next((s.split("=", 1)[1] for s in overrides if s.startswith("init=")), "target")
    return name, [s for s in overrides if not s.startswith("init=")], init


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="tokenized training samples (a demo's tokenized/)")
    parser.add_argument("--eval", required=True, help="kept-aside prompts (a demo's prompts-eval/)")
    parser.add_argument("--unseen", required=True, help="prompts of unseen kinds (a demo's prompts-unseen/)")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="of each greedy answer scored")
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE,... (see the docstring)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from bench.side_by_side import train_side_by_side
    from dflash_ray.drafter.export import from_hf_config
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.registry import SMOLLM2, resolve
    from dflash_ray.stages.demo import demo_config
    from dflash_ray.train.drafters import union_layers
    from dflash_ray.train.schedule import Schedule, dataset_samples
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    target_dir = str(resolve(SMOLLM2))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    sets = {
        name: answers_file(
            greedy_answers(uri, work / f"{name}.json", target_dir, tokenizer, args.max_new_tokens),
            work / f"{name}.parquet",
        )
        for name, uri in (("kept_aside", args.eval), ("unseen", args.unseen))
    }
    specs = [variant(s) for s in (args.variant or ["base:"])]
    common = ["train.torch_threads=2", "train.dtype=bfloat16"]
    cfgs = {name: demo_config(None, common + overrides) for name, overrides, _ in specs}
    dcfgs = {name: drafter_config(SMOLLM2, cfg) for name, cfg in cfgs.items()}
    layers, picks = union_layers([list(from_hf_config(dcfgs[name]).target_layer_ids) for name, _, _ in specs])
    base = cfgs[specs[0][0]]
    target = TargetWorker(SMOLLM2, layers, base.train)
    workers = {
        name: DrafterWorker(SMOLLM2, json.dumps(dcfgs[name]), init, cfgs[name].train, 0, 1, pick)
        for (name, _, init), pick in zip(specs, picks)
    }
    samples = dataset_samples(args.data)
    schedule = Schedule(samples, 1, 2, base.train.seed)
    train_side_by_side(target, workers, schedule, args.steps, f"{len(workers)} recipes")
    rows = []
    lookup: dict[str, Any] = {"variant": "prompt lookup", "settings": [], "init": None, "steps": 0}
    ngram = (base.evaluate.ngram_min, base.evaluate.ngram_max)
    for name, overrides, init in specs:
        worker = workers[name]
        row: dict[str, Any] = {"variant": name, "settings": overrides, "init": init, "steps": args.steps}
        for set_name, refs in sets.items():
            batches = [worker_batch(target, worker, ref) for ref in refs]
            row[set_name], on_blocks = score(worker, batches, ngram)
            lookup.setdefault(set_name, on_blocks)  # on the first recipe's blocks (its drafts a block)
        rows.append(row)
        print(json.dumps(row) if args.json else row, flush=True)
    drafts = max(len(lookup[set_name]["by_position"]) for set_name in sets)
    lookup["settings"] = [f"drafts={drafts}", f"n={ngram[0]}..{ngram[1]}"]
    rows.append(lookup)
    print(json.dumps(lookup) if args.json else lookup, flush=True)
    (work / "results.json").write_text(json.dumps(rows, indent=1))


def worker_batch(target, worker, ref) -> dict[str, Any]:
    """One scoring sample's batch with this drafter's own target layers."""
    batch = target.features([ref])
    return {**batch, "features": worker._features(batch).cpu()}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
