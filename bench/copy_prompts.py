"""Prompts that make the target copy: a passage from the inputs' own texts (their user messages and
answers) quoted inside a task that repeats or rearranges it. The question it answers: does a drafter
learn to copy from its context (where prompt lookup beats it on unseen kinds) when its data holds
answers that copy? Scored with `bench.first_position` on the demo's samples plus these.

The tasks are chosen apart from the unseen-kinds prompts (no formal rewrite, summary, spelling fix,
extraction to JSON, list of dates): a drafter scored on those still meets them for the first time.

    .venv/bin/python -m bench.copy_prompts --count 320 --output /tmp/copy/copy-prompts.jsonl
    .venv/bin/dflash-ray prompts --input /tmp/copy/copy-prompts.jsonl --output /tmp/copy/prompts ...
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TASKS = (
    "Repeat this text word for word: '{p}'",
    "Quote the first sentence of this text, then explain it in your own words: '{p}'",
    "Put each sentence of the following text on its own numbered line:\n\n{p}",
    "Continue this text with two more sentences, writing the text itself first:\n\n{p}",
    "Give this text a title, then write the text out again under it:\n\n{p}",
    "Someone asked: '{p}'. Repeat their request back to them, then answer it.",
    "Quote the words in this text that carry its main point, one per line: '{p}'",
    "Write this text again with every number spelled out in words: '{p}'",
)


def passages(inputs: list[str], min_chars: int = 40) -> list[str]:
    """The distinct user messages and answers of the inputs' readable records, sorted."""
    from dflash_ray.data.formats import BadRecord, normalize, normalize_answered
    from dflash_ray.data.records import iter_records

    texts: set[str] = set()
    for uri in inputs:
        for raw in iter_records(uri):
            if raw.error is not None:
                continue
            try:
                texts.update(m["content"] for p in normalize(raw.record) for m in p.messages if m["role"] == "user")
                texts.add(normalize_answered(raw.record).text)
            except BadRecord:  # a record with no answer still gave its messages
                continue
    return sorted(t.strip() for t in texts if len(t.strip()) >= min_chars)


def copy_prompts(texts: list[str], count: int, seed: int = 0) -> list[dict]:
    """`count` chat records, every passage used once before any twice, each with a seeded task."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        passage = texts[i] if i < len(texts) else rng.choice(texts)
        task = TASKS[rng.randrange(len(TASKS))]
        records.append({"messages": [{"role": "user", "content": task.format(p=passage)}]})
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=320)
    parser.add_argument("--output", required=True, help="a chat JSONL `dflash-ray prompts` reads")
    parser.add_argument("--input", nargs="+", help="datasets to quote (default: the demo's bundled prompts)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dflash_ray.stages.demo import bundled_inputs

    texts = passages(args.input or bundled_inputs())
    records = copy_prompts(texts, args.count)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"output": args.output, "passages": len(texts), "prompts": len(records)}
    print(json.dumps(summary) if args.json else summary)


if __name__ == "__main__":
    main()
