"""Degenerate generations, caught before they reach training data.

A drafter learns whatever the target wrote; a loop repeated a thousand times teaches it to loop.
Each check names what it saw, so the rejected record carries a reason a person can act on:

- `repetition`: the output ends in a cycle of at most `repeat_max_period` tokens that covers its
  last `repeat_min_span` tokens and at least three full periods (a model stuck in a loop);
- `tool_call_loop`: a prompt with tools (and no tool runtime to answer) whose answer opens more
  than `max_tool_calls` `<tool_call>` blocks;
- `truncated`: the engine stopped at `max_tokens` (the config decides: keep or reject);
- `empty_answer`: the model stopped with nothing after its thinking block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_ray.config import GenerateConfig

KINDS = ("repetition", "tool_call_loop", "truncated", "empty_answer")
TOOL_CALL = "<tool_call>"


@dataclass(frozen=True, slots=True)
class Degenerate:
    kind: str
    reason: str


def tail_cycle(token_ids: list[int] | np.ndarray, max_period: int, min_span: int) -> tuple[int, int] | None:
    """The shortest period p <= max_period with which the output's tail repeats, and the tail's
    length, when that tail covers at least max(min_span, 3p) tokens; else None."""
    ids = np.asarray(token_ids, dtype=np.int64)
    for period in range(1, max_period + 1):
        need = max(min_span, 3 * period)
        if len(ids) < need + period:
            break
        same = ids[period:] == ids[:-period]  # same[i]: ids[i + period] == ids[i]
        if same[-need:].all():
            run = len(same) - (np.flatnonzero(~same)[-1] + 1 if (~same).any() else 0)
            return period, run + period
    return None


def classify(
    output_ids: list[int], raw_text: str, answer: str, finish_reason: str, has_tools: bool, cfg: GenerateConfig
) -> Degenerate | None:
    """The first degenerate kind the output shows, in the order of KINDS, or None.

    `raw_text` is the decoded output with special tokens kept; `answer` the part after thinking.
    """
    cycle = tail_cycle(output_ids, cfg.repeat_max_period, cfg.repeat_min_span)
    if cycle is not None:
        period, span = cycle
        return Degenerate("repetition", f"the last {span} of {len(output_ids)} tokens repeat a {period}-token cycle")
    calls = raw_text.count(TOOL_CALL)
    if has_tools and calls > cfg.max_tool_calls:
        return Degenerate(
            "tool_call_loop",
            f"{calls} {TOOL_CALL} blocks in one answer (more than {cfg.max_tool_calls}): no tool runtime answers them",
        )
    if finish_reason == "length":
        return Degenerate("truncated", f"stopped at max_tokens ({len(output_ids)} tokens)")
    if not answer.strip():
        return Degenerate("empty_answer", "no answer after the thinking block")
    return None
