"""One work unit of generation, without Ray: prompt rows → engine → completion and rejected records.

The prompt is rendered here with the target's chat template (thinking flag, tools, extra template
kwargs from config) and the engine receives token ids, so `prompt_token_ids` is exactly what the
engine saw and tokenization can replay it. A prompt that cannot be rendered or is too long for the
engine, and a prompt the engine fails on, is rejected with its reason; the rest of the shard goes on.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from dflash_ray import storage
from dflash_ray.config import GenerateConfig
from dflash_ray.data import schema
from dflash_ray.data.formats import BadRecord
from dflash_ray.generation.degenerate import classify
from dflash_ray.generation.engines import Engine, Output

THINK_END = "</think>"


def prompt_seed(seed: int, prompt_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sample_id(prompt_id: str, sample: int) -> str:
    """The record id of a prompt's `sample`-th completion: the prompt id itself for the first."""
    return prompt_id if sample == 0 else f"{prompt_id}#{sample}"


def prompt_of(record_id: str) -> str:
    """The prompt id a record id came from (inverse of `sample_id`)."""
    head, sep, tail = record_id.rpartition("#")
    return head if sep and tail.isdigit() else record_id


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(thinking, answer): the thinking block's content when the output has one."""
    if THINK_END not in text:
        return None, text.strip()
    thinking, answer = text.split(THINK_END, 1)
    return thinking.replace("<think>", "", 1).strip(), answer.strip()


@dataclass(slots=True)
class ShardResult:
    completions: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)  # id, source, kind, reason, record
    output_tokens: int = 0  # every generated token, rejected outputs included
    seconds: float = 0.0  # engine time
    conversations_cut: int = 0  # kept up to the last turn whose prompt fit max_model_len

    def counts(self) -> dict[str, int]:
        out = {"completions": len(self.completions), "rejected": len(self.rejects)}
        for r in self.rejects:
            out[r["kind"]] = out.get(r["kind"], 0) + 1
        out["truncated_kept"] = sum(1 for c in self.completions if c["finish_reason"] == "length")
        out["conversations_cut"] = self.conversations_cut
        return out


class ShardGenerator:
    def __init__(self, tokenizer, engine: Engine, cfg: GenerateConfig, model_name: str, generator_id: str):
        self.tokenizer, self.engine, self.cfg = tokenizer, engine, cfg
        self.model_name, self.generator_id = model_name, generator_id

    def render(self, row: dict[str, Any]) -> list[int]:
        tools = json.loads(row["tools"]) if row.get("tools") else None
        try:
            text = self.tokenizer.apply_chat_template(
                row["messages"], tools=tools, add_generation_prompt=True, tokenize=False,
                enable_thinking=self.cfg.enable_thinking, **self.cfg.chat_template_kwargs)
        except Exception as e:  # jinja errors carry no common base class
            raise BadRecord(f"chat template error: {e}", "template_error") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= self.cfg.max_model_len:
            raise BadRecord(f"prompt has {len(ids)} tokens; the engine's max_model_len is "
                            f"{self.cfg.max_model_len}", "prompt_too_long")
        return ids

    def _generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Output | Exception]:
        try:
            return list(self.engine.generate(prompts, seeds))
        except Exception:  # isolate the prompt that broke the batch
            outs: list[Output | Exception] = []
            for p, s in zip(prompts, seeds):
                try:
                    outs += self.engine.generate([p], [s])
                except Exception as e:
                    outs.append(e)
            return outs

    def run(self, rows: list[dict[str, Any]], heartbeat: Callable[[], None] = lambda: None) -> ShardResult:
        """Every prompt row's completions, a user turn at a time: all conversations' first turns in
        batches, then the second turns of those that have one (with their answers in the history), and
        so on. A conversation with a degenerate answer is rejected whole, naming the turn; one whose next
        prompt outgrows `max_model_len` is kept up to the turn before."""
        result = ShardResult()
        ready: list[tuple[Conversation, list[int]]] = []
        for row in rows:
            conv = Conversation.of(row)
            try:
                ids = self.render(conv.prompt())
            except BadRecord as e:
                result.rejects.append(_reject(row, e.kind, str(e)))
                continue
            ready += [(conv.sample(i), ids) for i in range(self.cfg.samples_per_prompt)]
        while ready:
            ready = self._turn(ready, result, heartbeat)
        return result

    def _turn(self, ready: list[tuple[Conversation, list[int]]], result: ShardResult,
              heartbeat: Callable[[], None]) -> list[tuple[Conversation, list[int]]]:
        """One turn of every conversation in `ready`; returns those with a next turn, rendered."""
        import time

        following = []
        for start in range(0, len(ready), self.cfg.batch_size):
            batch = ready[start:start + self.cfg.batch_size]
            seeds = [conv.seed(self.cfg.seed) for conv, _ in batch]
            began = time.perf_counter()
            outs = self._generate([ids for _, ids in batch], seeds)
            result.seconds += time.perf_counter() - began
            for (conv, ids), seed, out in zip(batch, seeds, outs):
                row = conv.prompt()
                if isinstance(out, Exception):
                    result.rejects.append(_reject(row, "engine_error", f"{conv.where()}engine failed: {out}"))
                    continue
                result.output_tokens += len(out.token_ids)
                record, bad = self._completion(row, ids, out, seed)
                if not self._keeps(bad):
                    result.rejects.append(_reject(row, bad.kind, conv.where() + bad.reason, record))
                    continue
                if not conv.pending:
                    result.completions.append(record)
                    continue
                conv.answer(record["text"])
                try:
                    following.append((conv, self.render(conv.prompt())))
                except BadRecord as e:
                    if e.kind != "prompt_too_long":
                        result.rejects.append(_reject(row, e.kind, conv.where() + str(e)))
                        continue
                    result.completions.append(record)  # the turns that fit the engine are kept
                    result.conversations_cut += 1
            heartbeat()
        return following

    def _completion(self, row: dict[str, Any], ids: list[int], out: Output, seed: int):
        """The completion record of one engine output, and what is wrong with it (None: nothing)."""
        raw = self.tokenizer.decode(out.token_ids, skip_special_tokens=False)
        reasoning, answer = split_reasoning(self.tokenizer.decode(out.token_ids, skip_special_tokens=True))
        c = self.cfg
        sampling = {"temperature": c.temperature, "top_p": c.top_p, "max_tokens": c.max_tokens, "seed": seed,
                    "enable_thinking": c.enable_thinking, "chat_template_kwargs": c.chat_template_kwargs,
                    "backend": c.backend}
        record = {**{k: row.get(k) for k in schema.PROMPTS.names},
                  "prompt_token_ids": ids, "output_token_ids": out.token_ids, "text": answer,
                  "reasoning": reasoning, "finish_reason": out.finish_reason,
                  "num_prompt_tokens": len(ids), "num_output_tokens": len(out.token_ids),
                  "model": self.model_name, "sampling": json.dumps(sampling, sort_keys=True),
                  "generator_id": self.generator_id}
        return record, classify(out.token_ids, raw, answer, out.finish_reason, bool(row.get("tools")), c)

    def _keeps(self, bad) -> bool:
        """The degenerate-output policy: nothing wrong, or a cut answer under `truncated=keep`."""
        return bad is None or (bad.kind == "truncated" and self.cfg.truncated == "keep")


@dataclass(slots=True)
class Conversation:
    """A prompt row on its way through its user turns: the messages so far (system, user turns, the
    target's answers) and the user turns still to answer. A row that is not `regenerate` is one turn."""
    row: dict[str, Any]
    history: list[dict[str, str]]
    pending: list[dict[str, str]]
    turn: int = 0

    @classmethod
    def of(cls, row: dict[str, Any]) -> Conversation:
        messages = list(row["messages"])
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
        cut = first + 1 if row.get("regenerate") else len(messages)
        return cls(row, messages[:cut], messages[cut:])

    def sample(self, index: int) -> Conversation:
        return Conversation({**self.row, "id": sample_id(self.row["id"], index)}, list(self.history),
                            list(self.pending), self.turn)

    def prompt(self) -> dict[str, Any]:
        """The row as the engine answers it now: its history up to the current user turn."""
        return {**self.row, "messages": list(self.history)}

    def answer(self, text: str) -> None:
        self.history = self.history + [{"role": "assistant", "content": text}, self.pending.pop(0)]
        self.turn += 1

    def seed(self, seed: int) -> int:
        """A turn's sampling seed: the first turn's is the prompt's own, as for a one-turn prompt."""
        return prompt_seed(seed, self.row["id"] if self.turn == 0 else f"{self.row['id']}/{self.turn}")

    def where(self) -> str:
        return f"turn {self.turn + 1}: " if self.row.get("regenerate") else ""


def _reject(row: dict[str, Any], kind: str, reason: str, record: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": row["id"], "source": row.get("source"), "kind": kind, "reason": reason,
            "record": record or {k: row.get(k) for k in schema.PROMPTS.names}}


def write_result(output: str, stem: str, result: ShardResult) -> dict[str, str]:
    """The rejected records, then the completions shard (each atomic); returns the file names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rejected, completions = f"rejected-{stem}.jsonl", f"completions-{stem}.parquet"
    storage.write_text(storage.join(output, rejected),
                       "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.rejects))
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(result.completions, schema=schema.COMPLETIONS), sink)
    storage.write_bytes(storage.join(output, completions), sink.getvalue())
    return {"completions": completions, "rejected": rejected}
