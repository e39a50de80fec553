"""The n-gram prompt-lookup baseline (what vLLM ships as `ngram` speculative decoding).

Acceptance figures mean little without it: a small target that loops gets long n-gram matches for
free. Under greedy decoding the acceptance of any proposer is a function of the target's own
output, so it is simulated exactly on that output, no engine needed. Lookup proposes nothing when
no suffix matches; vLLM averages its acceptance over the steps that had a draft only, so both
figures are reported, named apart (`evaluate`: `tau_ngram`, `tau_ngram_per_draft`).
"""

from __future__ import annotations

from typing import NamedTuple


def propose(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []


def accepted_at(tokens: list[int], anchor: int, drafts: int, min_n: int, max_n: int) -> int:
    """Drafts lookup gets accepted in a row from a block anchored at `anchor` of a greedy output
    (its context: `tokens` up to the anchor; the tokens after it are what the target wrote), the
    unit `teacher_forced.blocks_accepted` scores a drafter in."""
    draft = propose(tokens[: anchor + 1], drafts, min_n, max_n)
    return leading_matches(draft, tokens[anchor + 1 :])


def leading_matches(draft: list[int], truth: list[int]) -> int:
    """How many of the draft's tokens, from the first, equal what the target wrote."""
    accepted = 0
    while accepted < min(len(draft), len(truth)) and draft[accepted] == truth[accepted]:
        accepted += 1
    return accepted


class Step(NamedTuple):
    """One verify step of lookup: tokens committed (accepted + 1, fewer at the output's end), tokens
    drafted (0: no suffix matched, no draft) and tokens accepted."""

    commit: int
    drafted: int
    accepted: int


def simulate_steps(
    prompt: list[int], output: list[int], num_tokens: int = 15, min_n: int = 2, max_n: int = 4
) -> list[Step]:
    """Every verify step if n-gram lookup had drafted `output` after `prompt`."""
    steps = []
    done = 1  # the first output token comes from the prefill, as with any drafter
    while done < len(output):
        draft = propose(prompt + output[:done], num_tokens, min_n, max_n)
        accepted = leading_matches(draft, output[done:])
        commit = min(accepted + 1, len(output) - done)
        steps.append(Step(commit, len(draft), accepted))
        done += commit
    return steps
