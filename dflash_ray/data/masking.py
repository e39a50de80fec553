"""Completion records → `input_ids` + `loss_mask` (no Ray: the Ray Data stage wraps this).

Two paths:
- Replay: when the record holds the engine's `prompt_token_ids` and `output_token_ids`, the sample
  is exactly those ids and the mask is 1 on every output id. Re-tokenizing text would drift from
  what the target actually produced. Ids outside the tokenizer's vocabulary, or no output ids, refuse
  the record alone (the gate would refuse the whole dataset).
- Render: otherwise the conversation is rendered with the tokenizer's chat template, the thinking
  block included, and the mask is derived from character offsets: 1 on exactly the tokens of the
  assistant response (thinking, answer, end-of-turn token), 0 on the prompt and on the
  `<|im_start|>assistant\\n` header. The prompt is rendered with the generation prompt, as the
  engine saw it, so its end marks where the response starts. An answer the template does not render
  (tool calls it drops, nothing but the end of the turn) is refused, not trained on as empty.

A conversation the target answered turn by turn (`regenerate`) also trains on its earlier answers,
as the chat template renders them in the last turn's prompt (a thinking template drops their
thinking there, as it does when the conversation is served): each answer's text and the end-of-turn
token after it, found by character offsets in the rendered history; replayed prompt ids must be that
rendering, token for token.

Text a record gives (a turn's content, the answer, its thinking, tool schemas and calls) that holds
one of the tokenizer's special tokens literally (`<|im_end|>\n<|im_start|>user` inside an answer) is
refused, naming the field and the token (`refuse_special_tokens`): the tokenizer reads it as the
token itself, a turn boundary the conversation does not have, and the loss mask would be blamed.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from dflash_ray.config import TokenizeConfig
from dflash_ray.data.formats import BadRecord, canonical_json, loads_finite


@dataclass(slots=True)
class Sample:
    input_ids: np.ndarray  # int32 [S]
    loss_mask: np.ndarray  # int8 [S]
    truncated: bool = False
    cut: int = 0  # tokens truncation removed: generated (or written) but not trained on


INT32_MAX = 2**31 - 1


def token_ids(values: Any, field: str) -> np.ndarray:
    """Token ids as a record holds them (a JSONL record can hold anything): ints in int32 range."""
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise BadRecord(f"{field}: must be a list of token ids, got {type(values).__name__}", "bad_field")
    try:
        ids = np.asarray(values)
    except ValueError:  # ragged nesting
        ids = np.zeros((0, 0))
    if ids.ndim == 1 and ids.size == 0:
        return ids.astype(np.int32)
    if ids.ndim == 1 and ids.dtype.kind in "iu" and ids.min() >= 0 and ids.max() <= INT32_MAX:
        return ids.astype(np.int32)
    for i, v in enumerate(values):  # the first bad one, for the reason
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= INT32_MAX:
            raise BadRecord(f"{field}[{i}]: {v!r} is not a token id (an integer from 0 to {INT32_MAX})", "bad_field")
    raise BadRecord(f"{field}: not a flat list of token ids", "bad_field")


@functools.lru_cache(maxsize=8)
def _special_pattern(tokenizer) -> re.Pattern | None:
    """One pattern of the tokenizer's special tokens' strings (None: it has none, or it splits them
    in text as any other text), built once per tokenizer. The added tokens that are not special
    (Qwen's `<think>`, `<tool_call>`) are what models write in their text, and are left alone."""
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {t.content for t in added.values() if getattr(t, "special", False)}
    tokens |= {t for t in getattr(tokenizer, "all_special_tokens", ()) if isinstance(t, str)}
    tokens.discard("")
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def refuse_special_tokens(tokenizer, fields: Iterable[tuple[str, Any]]) -> None:
    """Refuse a record whose text holds a special token of `tokenizer` literally: `fields` are (name,
    text or a JSON value, as the chat template renders it) pairs; the first hit names its field and
    the token."""
    pattern = _special_pattern(tokenizer)
    if pattern is None:
        return
    for field, value in fields:
        if value is None or isinstance(value, (bool, int, float)):
            continue
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        found = pattern.search(text)
        if found:
            raise BadRecord(
                f"{field}: holds the tokenizer's special token {found.group(0)!r} as text, at character "
                f"{found.start()}: it would be read as the token itself (a turn boundary or an end of text "
                "the conversation does not have), not as the text written",
                "special_token",
            )


def conversation_fields(messages: list[dict[str, Any]], tools: Any = None) -> list[tuple[str, Any]]:
    """The text a conversation's turns and tool schemas give, named by field, for `refuse_special_tokens`."""
    fields = [(f"messages[{i}].{key}", value) for i, m in enumerate(messages) for key, value in m.items()]
    return fields + [("tools", tools)]


def _template(tokenizer, messages: list[dict[str, str]], **kwargs) -> str:
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # jinja errors carry no common base class
        raise BadRecord(f"chat template error: {e}", "template_error") from None


def earlier_answers(
    tokenizer, messages: list[dict[str, str]], text: str, offsets: np.ndarray, ids: np.ndarray, **kwargs
) -> np.ndarray:
    """1 on the tokens of every assistant turn in `messages` within `text` (their rendering, with
    the generation prompt after them): the answer's text and the end-of-turn token that follows it,
    not the turn's header. `offsets` are the tokens' start characters."""
    from dflash_ray.registry import stop_token_ids

    stops = np.asarray(stop_token_ids(tokenizer))
    mask = np.zeros(len(ids), dtype=np.int8)
    for j, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"].strip():
            continue
        before = _template(tokenizer, messages[:j], tokenize=False, **kwargs)
        answer = m["content"].strip()
        start = text.find(answer, len(before)) if text.startswith(before) else -1
        if start < 0:
            raise BadRecord(
                f"messages[{j}]: the assistant turn is not in the rendered conversation "
                "(a chat template that rewrites earlier answers)",
                "template_error",
            )
        inside = (offsets >= start) & (offsets < start + len(answer))
        mask[inside] = 1
        after = int(np.searchsorted(offsets, start + len(answer)))
        if after < len(ids) and np.isin(ids[after], stops):
            mask[after] = 1
    return mask


def _regenerated(record: dict[str, Any]) -> bool:
    return bool(record.get("regenerate")) and any(m.get("role") == "assistant" for m in _messages(record))


def _history_mask(tokenizer, record: dict[str, Any], prompt: np.ndarray, enable_thinking: bool) -> np.ndarray:
    """The earlier answers' mask over a replayed prompt, which must be the rendered history."""
    messages = _messages(record)
    kwargs = {"tools": _tools(record), "enable_thinking": enable_thinking}
    refuse_special_tokens(tokenizer, conversation_fields(messages, kwargs["tools"]))
    text = _template(tokenizer, messages, add_generation_prompt=True, tokenize=False, **kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if encoded["input_ids"] != prompt.tolist():
        raise BadRecord(
            "prompt_token_ids: not the chat template's rendering of messages (tokenize.tokenizer "
            "and tokenize.enable_thinking must be generation's)",
            "template_error",
        )
    offsets = np.asarray([s for s, _ in encoded["offset_mapping"]], dtype=np.int64)
    return earlier_answers(tokenizer, messages, text, offsets, prompt, **kwargs)


def replay(prompt_ids: list[int], output_ids: list[int], vocab: int | None = None) -> Sample:
    """The engine's ids as they are, the output's trained on. `vocab`: the tokenizer's size, which
    every id must be under (ids of another model's tokenizer would fail the gate, and the dataset)."""
    prompt = token_ids(prompt_ids, "prompt_token_ids")
    output = token_ids(output_ids, "output_token_ids")
    if not output.size:
        raise BadRecord("output_token_ids: empty: an answer of no tokens has nothing to train on", "empty_response")
    for field, ids in (("prompt_token_ids", prompt), ("output_token_ids", output)):
        if vocab is not None:
            refuse_outside(ids, vocab, field, "tokenize.tokenizer must be the one that generated them")
    ids = np.concatenate([prompt, output])
    mask = np.zeros(len(ids), dtype=np.int8)
    mask[len(prompt) :] = 1
    return Sample(ids, mask)


def refuse_outside(ids: np.ndarray, vocab: int, field: str, hint: str) -> None:
    """Refuse ids (`token_ids`) past a tokenizer's `vocab`: another model's tokenizer made them (`hint`
    says which setting to check)."""
    if ids.size and ids.max() >= vocab:
        k = int(np.flatnonzero(ids >= vocab)[0])
        raise BadRecord(
            f"{field}[{k}]: token id {int(ids[k])} is outside the tokenizer's vocabulary of {vocab} "
            f"(ids of another model's tokenizer? {hint})",
            "out_of_vocabulary",
        )


def _messages(record: dict[str, Any]) -> list[dict[str, str]]:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRecord("messages: missing or empty", "missing_field")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRecord(f"messages[{i}].role: missing or not a string", "missing_field")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise BadRecord(f"messages[{i}].content: must be a string, got {type(content).__name__}", "bad_field")
        message = {"role": m["role"], "content": content or ""}
        calls = _json_list(m.get("tool_calls"), f"messages[{i}].tool_calls", "tool calls")
        if calls:
            message["tool_calls"] = calls
        if m.get("tool_call_id"):
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    return out


def _json_list(raw: Any, field: str, of: str) -> list | None:
    """A list a record stores as JSON (tool schemas, tool calls), as the chat template takes it."""
    if not raw:
        return None
    if isinstance(raw, str):
        try:
            raw = loads_finite(raw)
        except json.JSONDecodeError as e:
            raise BadRecord(f"{field}: not valid JSON ({e.msg} at column {e.colno})", "bad_field") from None
        except BadRecord as e:  # a key given twice
            raise BadRecord(f"{field}: {e}", e.kind) from None
        except ValueError as e:  # NaN, Infinity: Python reads them, JSON has no such number
            raise BadRecord(f"{field}: {e}", "bad_field") from None
    if not isinstance(raw, list):
        raise BadRecord(f"{field}: must be a JSON list of {of}, got {type(raw).__name__}", "bad_field")
    canonical_json(raw, field)  # NaN in a record's list: the template's `tojson` would write invalid JSON
    return raw


def _tools(record: dict[str, Any]) -> list | None:
    return _json_list(record.get("tools"), "tools", "tool schemas")


def render(tokenizer, record: dict[str, Any], enable_thinking: bool = True) -> Sample:
    """Render prompt + response with the chat template and mask the response by offsets."""
    messages = _messages(record)
    text = record.get("text")
    if not isinstance(text, str):
        raise BadRecord("text: missing (and no token ids to replay)", "missing_field")
    reasoning = record.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise BadRecord(f"reasoning: must be a string, got {type(reasoning).__name__}", "bad_field")
    tools = _tools(record)
    kwargs = {"tools": tools, "tokenize": False, "enable_thinking": enable_thinking}
    reply: dict[str, Any] = {"role": "assistant", "content": text}
    calls = _json_list(record.get("tool_calls"), "tool_calls", "tool calls")
    if calls:  # an answer that calls tools: the template renders the calls, trained on like any answer
        reply["tool_calls"] = calls
    if reasoning is not None:
        reply["reasoning_content"] = reasoning
    answer = [("text", text), ("reasoning", reasoning), ("tool_calls", calls)]
    refuse_special_tokens(tokenizer, conversation_fields(messages, tools) + answer)
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        full = tokenizer.apply_chat_template(messages + [reply], **kwargs)
        if reasoning and reasoning.strip() and reasoning.strip() not in full[len(prompt) :]:
            # A template that ignores `reasoning_content`: put the block in the content itself.
            reply = {**reply, "content": f"<think>\n{reasoning.strip()}\n</think>\n\n{text}"}
            reply.pop("reasoning_content")
            full = tokenizer.apply_chat_template(messages + [reply], **kwargs)
    except Exception as e:  # jinja errors carry no common base class
        raise BadRecord(f"chat template error: {e}", "template_error") from None
    if not full.startswith(prompt):
        raise BadRecord("chat template renders the prompt differently with and without the reply", "template_error")
    start, end = len(prompt), len(full.rstrip())  # drop the newline the template adds after the turn
    encoded = tokenizer(full[:end], add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    starts = np.asarray([s for s, _ in encoded["offset_mapping"]], dtype=np.int64)
    mask = (starts >= start).astype(np.int8)
    _check_rendered(tokenizer, full[start:end], calls, ids[mask.astype(bool)])
    if _regenerated(record):
        mask |= earlier_answers(
            tokenizer, messages, full[:end], starts, ids, tools=tools, enable_thinking=enable_thinking
        )
    return Sample(ids, mask)


def _check_rendered(tokenizer, response: str, calls: list | None, answer_ids: np.ndarray) -> None:
    """Refuse an answer the chat template does not render: tool calls it drops (a template without
    tools), or nothing but the end of the turn to train on."""
    from dflash_ray.registry import stop_token_ids

    names = [
        c["function"].get("name") for c in calls or () if isinstance(c, dict) and isinstance(c.get("function"), dict)
    ]
    missing = [n for n in names if isinstance(n, str) and n and n not in response]
    empty = not np.isin(answer_ids, stop_token_ids(tokenizer), invert=True).any()
    if missing:
        raise BadRecord(
            f"tool_calls: the chat template does not render the answer's tool calls ({', '.join(missing)} missing): "
            + ("it renders no answer tokens" if empty else "the answer would be trained on without them"),
            "template_error",
        )
    if empty:
        raise BadRecord("the chat template renders no answer tokens: nothing but the end of the turn", "empty_response")


def apply_length_policy(sample: Sample, cfg: TokenizeConfig) -> Sample:
    if len(sample.input_ids) <= cfg.max_seq_len:
        return sample
    if cfg.overlong == "drop":
        raise BadRecord(f"{len(sample.input_ids)} tokens, over max_seq_len {cfg.max_seq_len}", "overlong")
    cut = Sample(
        sample.input_ids[: cfg.max_seq_len],
        sample.loss_mask[: cfg.max_seq_len],
        True,
        len(sample.input_ids) - cfg.max_seq_len,
    )
    if not cut.loss_mask.any():
        raise BadRecord(f"prompt fills max_seq_len {cfg.max_seq_len}: no response token left", "overlong")
    return cut


def tokenize_record(tokenizer, record: Any, cfg: TokenizeConfig) -> Sample:
    if not isinstance(record, dict):
        raise BadRecord(f"record is a JSON {type(record).__name__}, not an object", "unknown_schema")
    if record.get("id") is None or record["id"] == "":
        raise BadRecord("id: missing", "missing_field")
    prompt_ids, output_ids = record.get("prompt_token_ids"), record.get("output_token_ids")
    if prompt_ids is not None and output_ids is not None:
        sample = replay(prompt_ids, output_ids, len(tokenizer))
        if _regenerated(record):
            prompt_len = len(sample.input_ids) - len(output_ids)
            sample.loss_mask[:prompt_len] = _history_mask(
                tokenizer, record, sample.input_ids[:prompt_len], cfg.enable_thinking
            )
    else:
        sample = render(tokenizer, record, cfg.enable_thinking)
    return apply_length_policy(sample, cfg)


class TokenizeBatch:
    """Callable over a batch of completion rows; loads the tokenizer once (per Ray Data worker)."""

    def __init__(self, cfg: TokenizeConfig):
        from dflash_ray.registry import load_tokenizer

        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer)

    def __call__(
        self, rows: list[Any], where: list[dict[str, Any]] | None = None
    ) -> tuple[dict[str, list], list[dict[str, Any]]]:
        """Returns the tokenized columns and the rejected rows (id, kind, reason, and the row's
        `where`: its file and line)."""
        out: dict[str, list] = {
            k: [] for k in ("id", "source", "input_ids", "loss_mask", "seq_len", "truncated", "cut")
        }
        rejects = []
        for i, row in enumerate(rows):
            try:
                sample = tokenize_record(self.tokenizer, row, self.cfg)
            except BadRecord as e:
                rid = row.get("id") if isinstance(row, dict) else None
                rejects.append(
                    {
                        "id": None if rid is None else str(rid),
                        **(where[i] if where else {}),
                        "kind": e.kind,
                        "reason": str(e),
                    }
                )
                continue
            out["id"].append(str(row["id"]))
            out["source"].append(str(row.get("source") or ""))
            out["input_ids"].append(sample.input_ids)
            out["loss_mask"].append(sample.loss_mask)
            out["seq_len"].append(len(sample.input_ids))
            out["truncated"].append(sample.truncated)
            out["cut"].append(sample.cut)
        return out, rejects
