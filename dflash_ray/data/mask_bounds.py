"""Where each run of loss tokens must begin and end, per chat template (no Ray; `data.validate.scan` runs it).

`prompt_loss` catches a mask on the prompt, but a mask one token off passes it and every distribution:
shifted right (the answer's first token out, the newline after `<|im_end|>` in), shifted left (the
newline closing `<|im_start|>assistant` in, `<|im_end|>` out), or never covering `<|im_end|>` (the
drafter never learns where an answer stops). So, from token ids alone (no template rendered per
sample; datasets hold millions): a run of loss must begin on the first token of an assistant's
content (right after an assistant header, or after a generation prompt such as Qwen's non-thinking
`<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`), must end on the end-of-turn token (or EOS) and
not run past it, and no turn but the assistant's (a tool result, a user turn) carries loss. Each rule gives,
per sample, the first offending token's position in it, to decode it in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_ray.config import GateConfig

RULES = ("loss_shift", "end_of_turn", "non_assistant_loss")
PROBE = [{"role": "user", "content": "ping"}]
WINDOW = 10  # tokens decoded each side of an offending token


@dataclass(frozen=True, slots=True)
class Markers:
    """The token ids that mark turns in one chat template."""

    opener: int  # opens every turn (`<|im_start|>`): a turn runs from it to the next
    header: np.ndarray  # opens an assistant turn (`<|im_start|>assistant`)
    prefixes: tuple[np.ndarray, ...]  # end right before an answer's first token (`<|im_start|>assistant\n`)
    ends: np.ndarray  # what may end an answer: the template's end-of-turn token (`<|im_end|>`), and EOS


def _probe(tokenizer, messages: list[dict[str, str]], **kwargs) -> str | None:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # no chat template, or one that refuses the probe (jinja errors share no base class)
        return None
    return text if isinstance(text, str) else None


def _generation_prompts(tokenizer) -> list[str]:
    """What the template appends to ask for an answer, thinking and not (Qwen's differ)."""
    out = []
    for thinking in (True, False):
        asked = _probe(tokenizer, PROBE, add_generation_prompt=True, enable_thinking=thinking)
        plain = _probe(tokenizer, PROBE, add_generation_prompt=False, enable_thinking=thinking)
        if asked and plain is not None and asked.startswith(plain) and asked[len(plain) :].strip():
            out.append(asked[len(plain) :].lstrip())
    return out


def _ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def assistant_header(tokenizer) -> np.ndarray | None:
    """The token ids that open an assistant turn in the tokenizer's chat template: the first line of
    its generation prompt (`<|im_start|>assistant`); None for a tokenizer without a chat template."""
    prompts = _generation_prompts(tokenizer)
    ids = _ids(tokenizer, prompts[0].strip().split("\n")[0]) if prompts else None
    return ids if ids is not None and ids.size else None


def markers(tokenizer) -> Markers | str:
    """The template's turn markers, or why they cannot be found (the rules are then skipped)."""
    header = assistant_header(tokenizer)
    if header is None:
        return "the tokenizer has no chat template that asks for an answer"
    special = tokenizer.get_added_vocab()
    asked = _probe(tokenizer, PROBE) or ""
    if tokenizer.convert_ids_to_tokens(int(header[0])) not in special or int(header[0]) not in _ids(tokenizer, asked):
        return "the assistant header does not open with a special token that opens the user's turn too"
    reply = _probe(tokenizer, PROBE + [{"role": "assistant", "content": "pong"}])
    tail = _ids(tokenizer, reply[reply.rfind("pong") + 4 :].lstrip()) if reply and "pong" in reply else None
    if tail is None or tail.size == 0 or tokenizer.convert_ids_to_tokens(int(tail[0])) not in special:
        return "the template ends an answer with no special end-of-turn token"
    texts = set()
    for prompt in _generation_prompts(tokenizer):
        texts.add(prompt)  # the whole generation prompt: Qwen's non-thinking one holds an empty think block
        if "\n" in prompt:  # the header's line alone: how earlier answers of a conversation follow it
            texts.add(prompt[: prompt.index("\n") + 1])
    prefixes = tuple(p for p in (_ids(tokenizer, t) for t in sorted(texts)) if p.size)
    ends = {int(tail[0])} | ({tokenizer.eos_token_id} if isinstance(tokenizer.eos_token_id, int) else set())
    return Markers(int(header[0]), header, prefixes, np.asarray(sorted(ends), dtype=np.int64))


def matches(ids: np.ndarray, sample: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Where `pattern` starts in `ids`, lying within one sample (`sample`: each token's sample)."""
    size = pattern.size
    starts = np.flatnonzero(ids[: max(ids.size - size + 1, 0)] == pattern[0])
    for i in range(1, size):
        starts = starts[ids[starts + i] == pattern[i]]
    return starts[sample[starts] == sample[starts + size - 1]]


def _first(bad: np.ndarray, sample: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per sample, the position in it of its first `bad` token; -1 where none."""
    out = np.full(offsets.size - 1, -1, dtype=np.int32)
    where = np.flatnonzero(bad)
    rows = sample[where]
    first = np.concatenate([[True], rows[1:] != rows[:-1]]) if rows.size else np.zeros(0, dtype=bool)
    out[rows[first]] = where[first] - offsets[rows[first]]
    return out


def _turns(ids: np.ndarray, sample: np.ndarray, offsets: np.ndarray, marks: Markers) -> tuple[np.ndarray, np.ndarray]:
    """Per token: whether it lies in an assistant turn, and in another turn (from a turn's opener to
    the next one's; tokens before a sample's first opener are in neither)."""
    n = ids.size
    assistant = np.zeros(n, dtype=bool)
    assistant[matches(ids, sample, marks.header)] = True
    latest = np.maximum.accumulate(np.where(ids == marks.opener, np.arange(n), -1))
    in_turn = latest >= offsets[:-1][sample]
    in_assistant = in_turn & assistant[np.maximum(latest, 0)]
    return in_assistant, in_turn & ~in_assistant


def faults(ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, marks: Markers) -> dict[str, np.ndarray]:
    """Per rule of `RULES`, per sample: the position in it of the first offending token; -1 where
    none. And `open_end`: the length of a sample's last loss run where it reaches the sample's end
    without an end-of-turn token, a fault unless the sample was cut (`over_dataset` decides)."""
    n = ids.size
    sample = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    m = mask.astype(bool)
    nonempty = offsets[1:] > offsets[:-1]
    begin, end = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    begin[offsets[:-1][nonempty]] = True
    end[offsets[1:][nonempty] - 1] = True
    before = np.roll(m, 1) & ~begin  # the previous token, of the same sample, is under the loss
    run_start, run_end = m & ~before, m & ~(np.roll(m, -1) & ~end)
    in_assistant, in_other = _turns(ids, sample, offsets, marks)
    content = np.zeros(n + 1, dtype=bool)  # an answer's first token: right after a prefix, in the same sample
    for prefix in marks.prefixes:
        after = matches(ids, sample, prefix) + prefix.size
        content[after[(after < n) & (sample[np.minimum(after, n - 1)] == sample[after - 1])]] = True
    eot = np.isin(ids, marks.ends)
    past_eot = m & before & np.roll(eot, 1) & ~eot  # the loss runs on past an end-of-turn token
    shift = in_assistant & ((run_start & ~content[:n]) | past_eot)
    # each run's end against its start: whether an end-of-turn token lies under it
    eot_seen = np.concatenate([[0], np.cumsum(m & eot)])
    starts, ends = np.flatnonzero(run_start), np.flatnonzero(run_end)
    uncovered = ends[(eot_seen[ends + 1] == eot_seen[starts]) & in_assistant[ends]]
    no_eot = np.zeros(n, dtype=bool)
    no_eot[uncovered] = True
    return {
        "loss_shift": _first(shift, sample, offsets),
        "end_of_turn": _first(no_eot & ~end, sample, offsets),
        "non_assistant_loss": _first(m & in_other, sample, offsets),
        "open_end": _open_runs(no_eot & end, starts, ends, sample, offsets.size - 1),
    }


def _open_runs(
    open_end: np.ndarray, starts: np.ndarray, ends: np.ndarray, sample: np.ndarray, count: int
) -> np.ndarray:
    """Per sample, the length of its last loss run where `open_end` marks that run's end; -1 elsewhere."""
    out = np.full(count, -1, dtype=np.int32)
    last = open_end[ends]
    out[sample[ends[last]]] = ends[last] - starts[last] + 1
    return out


def over_dataset(
    found: dict[str, list[np.ndarray]], seq_lens: np.ndarray, on_prompt: np.ndarray
) -> dict[str, np.ndarray]:
    """The rules' positions over the dataset, from `faults` of each batch. A sample with loss on its
    prompt is counted there alone. A last run that reaches the sample's end without an end-of-turn
    token is a fault unless the sample was cut: as long as the longest sample (cut at
    tokenize.max_seq_len), or, of the others, that run as long as their longest such run (an answer
    cut at generate.max_tokens and kept by generate.truncated=keep: the engine's output, all of it
    under the loss)."""
    none = np.zeros(0, dtype=np.int32)
    out = {rule: np.concatenate(found[rule]) if found[rule] else none for rule in (*RULES, "open_end")}
    open_run = out.pop("open_end")
    was_cut = seq_lens == seq_lens.max(initial=0)
    was_cut |= open_run == open_run[~was_cut].max(initial=0)
    open_end = np.where((open_run >= 0) & ~was_cut, seq_lens.astype(np.int32) - 1, -1)
    out["end_of_turn"] = np.where(out["end_of_turn"] >= 0, out["end_of_turn"], open_end)
    return {rule: np.where(on_prompt, -1, at) for rule, at in out.items()}


def gate_rules(figures: dict[str, Any] | None, gate: GateConfig) -> list[dict[str, Any]]:
    """Each rule as `validate.gate_rules` gives it, from `validate.bound_stats`; where the markers are
    not found, each passes saying it was skipped. None where the figures were not measured."""
    if figures is None:
        return []
    out = []
    for rule, limit, says in (
        (
            "loss_shift",
            gate.max_loss_shift_share,
            "have a loss run one token off its turn: not starting on the answer's first token (right after "
            "the assistant header), or running past the end-of-turn token; the mask is shifted",
        ),
        (
            "end_of_turn",
            gate.max_end_of_turn_share,
            "have a loss run that does not end on the end-of-turn token (samples cut at the max length "
            "or at max_tokens aside): the drafter would never learn where an answer stops",
        ),
        (
            "non_assistant_loss",
            gate.max_non_assistant_loss_share,
            "have loss tokens inside a turn that is not the assistant's (a tool result, a user turn): "
            "training would teach the drafter words the target never wrote",
        ),
    ):
        if "skipped" in figures:
            value, passed, message = None, True, f"skipped: {figures['skipped']}"
        else:
            value, example = figures[rule], figures["examples"].get(rule)
            passed, message = value <= limit, f"{value:.1%} of samples {says} (limit: <= {limit:g})"
            message += f"; e.g. {example}" if example else ""
        out.append({"rule": rule, "value": value, "limit": limit, "passed": bool(passed), "message": message})
    return out


def marked(tokenizer, ids: np.ndarray, mask: np.ndarray, at: int) -> str:
    """The tokens around position `at`, decoded, the loss in ⟦ ⟧."""
    lo, hi = max(at - WINDOW, 0), at + WINDOW + 1
    edges = np.flatnonzero(np.diff(mask[lo:hi].astype(np.int8))) + 1
    return "".join(
        ("⟦{}⟧" if part_mask[0] else "{}").format(tokenizer.decode(part.tolist()))
        for part, part_mask in zip(np.split(ids[lo:hi], edges), np.split(mask[lo:hi], edges))
    )


def table_row(figures: dict[str, Any] | None) -> list[str]:
    """The report's table row (none where the figures were not measured)."""
    if figures is None:
        return []
    shown = figures.get("skipped") or " / ".join(format(figures[r], ".1%") for r in RULES)
    return [f"| loss runs one token off / not ending on end-of-turn / on a non-assistant turn | {shown} |"]
