"""Ray Data tokenization against a plain single-process loop, same tokenizer, same samples.

Both sides run the same work end to end: read the completion Parquet, render each conversation
with the Qwen3 chat template (thinking included), tokenize with offsets, build the loss mask and
write Parquet. Side by side in one run, since these machines are noisy.

    .venv/bin/python -m bench.tokenize [--samples 20000] [--json]

(Run as a module: as a script, this file would shadow the standard library's `tokenize`.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SEED_TOKENS_PER_S_PER_WORKER = 1.87e9 / (6.5 * 60) / 128  # 37.5K: the seed run, 128 workers
WORDS = (
    "the model reasons about each step before it answers so the drafter learns the target's own "
    "distribution of thinking tokens and code like def f(x): return x * 2 or math like 17 * 23 = 391 "
    "with lists, tables, proofs and short chat replies in several languages: bonjour, hola, ciao"
).split()


def synthetic_completions(n: int, seed: int = 0) -> pa.Table:
    """Chat samples sized like the seed's data: ~2,070 tokens each, ~87% of them response."""
    rng = np.random.default_rng(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))).tolist())

    rows = [
        {
            "id": f"s{i:07d}",
            "source": "synthetic",
            "messages": [{"role": "user", "content": text(20, 400)}],
            "tools": None,
            "reasoning": text(200, 2000),
            "text": text(50, 650),
            "finish_reason": "stop",
        }
        for i in range(n)
    ]
    return pa.Table.from_pylist(rows)


def single_process(src: str, out: str, cfg) -> int:
    from dflash_ray.data.masking import TokenizeBatch
    from dflash_ray.stages.tokenize import to_table

    fn = TokenizeBatch(cfg.tokenize)
    tokens = 0
    os.makedirs(out, exist_ok=True)
    for i, batch in enumerate(pq.ParquetFile(src).iter_batches(batch_size=cfg.tokenize.batch_size)):
        columns, _ = fn(batch.to_pylist())
        tokens += sum(columns["seq_len"])
        pq.write_table(to_table(columns), f"{out}/part-{i:05d}.parquet")
    return tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import ray

    from bench.local_ray import local_ray
    from dflash_ray import manifest
    from dflash_ray.config import load_config
    from dflash_ray.stages.tokenize import run_tokenize

    cfg = load_config(None, ["tokenize.tokenizer=qwen3", "tokenize.max_seq_len=8192"])
    work = tempfile.mkdtemp(prefix="bench-tokenize-")
    try:
        src_dir = f"{work}/completions"
        os.makedirs(src_dir)
        table = synthetic_completions(args.samples)
        # several input files so Ray Data has blocks to spread over its workers
        step = max(1, args.samples // 8)
        files = []
        for k, start in enumerate(range(0, args.samples, step)):
            name = f"part-{k:03d}.parquet"
            pq.write_table(table.slice(start, step), f"{src_dir}/{name}", row_group_size=500)
            files.append({"name": name, "rows": min(step, args.samples - start)})
        manifest.write_manifest(src_dir, kind="completions", files=files, summary={})
        single_src = f"{work}/all.parquet"
        pq.write_table(table, single_src)

        t0 = time.perf_counter()
        base_tokens = single_process(single_src, f"{work}/single", cfg)
        base_s = time.perf_counter() - t0

        with local_ray(num_cpus=os.cpu_count() or 2):
            num_cpus = int(ray.cluster_resources()["CPU"])  # a caller's cluster may have other than this machine's
            t0 = time.perf_counter()
            summary = run_tokenize(src_dir, f"{work}/ray", cfg)
            ray_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)

    assert summary["tokens"] == base_tokens, (summary["tokens"], base_tokens)
    tps, base_tps = base_tokens / ray_s, base_tokens / base_s
    result = {
        "case": "tokenize_chat_template",
        "samples": args.samples,
        "tokens": base_tokens,
        "cores": num_cpus,
        "tokens_per_s": round(tps),
        "baseline_tokens_per_s": round(base_tps),
        "ratio": round(tps / base_tps, 3),
        "tokens_per_s_per_core": round(tps / num_cpus),
        "seed_tokens_per_s_per_worker": round(SEED_TOKENS_PER_S_PER_WORKER),
        "per_core_vs_seed": round(tps / num_cpus / SEED_TOKENS_PER_S_PER_WORKER, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"ray data   : {result['tokens_per_s']:>10,} tokens/s ({ray_s:.1f} s)")
        print(f"single loop: {result['baseline_tokens_per_s']:>10,} tokens/s ({base_s:.1f} s)")
        print(f"ratio      : {result['ratio']}")
        print(
            f"per core   : {result['tokens_per_s_per_core']:,} tokens/s (seed: {result['seed_tokens_per_s_per_worker']:,} per worker)"
        )


if __name__ == "__main__":
    main()
