"""Drafters scored on a target's own greedy answers, decoded once and kept on disk (no Ray).

Real speculative decoding of every prompt for every drafter runs the target once a verify step; but
under greedy decoding the output is the target's greedy answer whatever the drafter, so the answer
is decoded once (`greedy_answers`, kept by `cached_answers` for every drafter, seed and rerun) and a
drafter is scored by one teacher-forced forward over it (`teacher_forced.walks`: the blocks greedy
decoding verifies, block for block). Prompt lookup is scored on the same answers as `evaluate`
scores it. `record` keeps each prompt's committed tokens and blocks and the counts by draft
position: they add over prompts and seeds (`intervals.Counts`), where taus and rates do not.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_ray.drafter import ngram
from dflash_ray.drafter.intervals import Counts
from dflash_ray.drafter.teacher_forced import Walk, position_counts, walks
from dflash_ray.target_model.capture import target_features


@dataclasses.dataclass(frozen=True)
class Answer:
    """One prompt's tokens and the target's greedy answer to it (cut at max_new_tokens and after its
    first stop token, as decoding outputs it)."""

    id: str
    source: str
    prompt: list[int]
    answer: list[int]


def greedy_answers(
    target, encoded: Sequence[tuple[dict[str, Any], list[int]]], max_new_tokens: int, eos_ids: set[int]
) -> list[Answer]:
    """The target's greedy answer to each (row, prompt ids), by the loop `evaluate` decodes its
    reference with (one token a forward, KV cache), so the answers are its references."""
    from dflash_ray.drafter.speculative import target_decode

    out = []
    for row, ids in encoded:
        tokens = target_decode(target, ids, max_new_tokens, eos_ids).token_ids
        out.append(Answer(str(row["id"]), str(row.get("source", "")), list(ids), tokens))
    return out


def cached_answers(path: Path, key: dict[str, Any], decode: Callable[[], list[Answer]]) -> list[Answer]:
    """The answers `path` holds for `key` (target, prompts, max_new_tokens...), else `decode()`'s,
    written there atomically: a run cut off mid-write leaves no half file to be read as whole."""
    if path.exists():
        held = json.loads(path.read_text())
        if held["key"] == key:
            return [Answer(**a) for a in held["answers"]]
    answers = decode()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"key": key, "answers": [dataclasses.asdict(a) for a in answers]}))
    os.replace(partial, path)
    return answers


def sequence(answer: Answer) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [1, S] (prompt then answer) and loss_mask [1, S] (1 on the answer)."""
    ids = torch.tensor([answer.prompt + answer.answer])
    mask = torch.zeros_like(ids)
    mask[:, len(answer.prompt) :] = 1
    return ids, mask


def answer_features(target, answers: Sequence[Answer], layer_ids: list[int]) -> list[torch.Tensor]:
    """[1, S, n*H] per answer: the target's outputs of `layer_ids` over prompt and answer, from one
    forward (what decoding feeds the drafter, token by token)."""
    return [target_features(target, sequence(a)[0], layer_ids) for a in answers]


def drafter_walks(
    drafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    features: Sequence[torch.Tensor],
    answers: Sequence[Answer],
    max_new_tokens: int,
    eos_ids: Collection[int],
) -> list[Walk]:
    """Per answer, the blocks greedy speculative decoding with `drafter` verifies (one answer a
    forward: no padding to reason about). An answer of one token has no block: the prefill made it."""
    out = []
    for answer, feats in zip(answers, features, strict=True):
        if len(answer.answer) < 2:
            out.append(Walk())
            continue
        ids, mask = sequence(answer)
        out += walks(drafter, embed_VH, head_VH, feats, ids, mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    return out


def lookup_walks(answers: Sequence[Answer], drafts: int, min_n: int, max_n: int) -> list[Walk]:
    """Per answer, n-gram prompt lookup's verify steps on it (`ngram.simulate_steps`, as `evaluate`
    scores it: each step anchored where the last one's committed tokens end, as `walk` anchors them)."""
    out = []
    for a in answers:
        steps = ngram.simulate_steps(a.prompt, a.answer, drafts, min_n, max_n)
        out.append(Walk([(s.drafted, s.accepted) for s in steps], [s.commit for s in steps]))
    return out


def record(answers: Sequence[Answer], scored: Sequence[Walk]) -> dict[str, Any]:
    """JSON-ready: each prompt's committed tokens and verify steps, tau over them all, and by draft
    position (blocks that reached it, blocks that accepted it)."""
    prompts: list[dict[str, Any]] = [
        {"id": a.id, "source": a.source, "tokens": sum(w.acceptance), "blocks": len(w.acceptance)}
        for a, w in zip(answers, scored, strict=True)
    ]
    tokens, blocks = sum(sum(w.acceptance) for w in scored), sum(len(w.acceptance) for w in scored)
    return {
        "tau": tokens / max(blocks, 1),
        "prompts": prompts,
        "position_counts": position_counts([v for w in scored for v in w.verified]),
    }


def counts(records: Sequence[dict[str, Any]]) -> Counts:
    """One arm's `intervals.Counts` from its `record`s, one a seed (the same prompts in each)."""
    ids = [[p["id"] for p in r["prompts"]] for r in records]
    assert all(i == ids[0] for i in ids), "every seed must be scored on the same prompts, in one order"
    tokens = [[p["tokens"] for p in r["prompts"]] for r in records]
    blocks = [[p["blocks"] for p in r["prompts"]] for r in records]
    return Counts(torch.tensor(tokens, dtype=torch.float64).T, torch.tensor(blocks, dtype=torch.float64).T)


def pooled_positions(records: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """(reached, accepted) per draft position, summed over the records (prompts and seeds together)."""
    width = max((len(r["position_counts"]) for r in records), default=0)
    return [
        (
            sum(r["position_counts"][k][0] for r in records if k < len(r["position_counts"])),
            sum(r["position_counts"][k][1] for r in records if k < len(r["position_counts"])),
        )
        for k in range(width)
    ]
