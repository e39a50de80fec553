"""Raw text for `pretrain`, as token ids: any of this project's datasets or a user's own files.

A document is one record (or one plain text file). Per record the first of these it has is read:
`input_ids` (a tokenized dataset: prompt and answer as training sees them), `prompt_token_ids` with
`output_token_ids` (a completions dataset), `messages` (a prompts dataset, or any chat records:
rendered with the target's chat template), `text` (plain text). Documents are joined end to end,
an end-of-text token between two, and cut into sequences of one length: the text's order inside a
sequence is kept, the sequences are shuffled in a seeded window.
"""

from __future__ import annotations

import json
import random
from typing import Any, Iterable, Iterator

from dflash_ray import manifest, storage
from dflash_ray.errors import DFlashError

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".parquet", ".jsonl", ".json")
COLUMNS = ("input_ids", "prompt_token_ids", "messages", "text")  # what a record is read from, in this order


def data_files(uri: str) -> list[str]:
    """The files of one source: a dataset of this project (its manifest's files), or a user's file
    or folder of text, JSONL, JSON or Parquet."""
    return manifest.dataset_files(uri, RECORD_SUFFIXES + TEXT_SUFFIXES)


def _record_ids(record: dict[str, Any], tokenizer, file: str, where: int) -> list[int] | None:
    """One record's token ids, from the first column of `COLUMNS` it has (None: an empty one)."""
    if record.get("input_ids") is not None:
        return [int(t) for t in record["input_ids"]]
    if record.get("prompt_token_ids") is not None:
        return [int(t) for t in record["prompt_token_ids"]] + [int(t) for t in record.get("output_token_ids") or []]
    if record.get("messages") is not None:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DFlashError("not a list of {role, content} turns", file=file, record=where, field="messages")
        turns = [{k: v for k, v in m.items() if v is not None} for m in messages]
        rendered = tokenizer.apply_chat_template(turns, tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"] or None
    text = record.get("text")
    if text is None:
        raise DFlashError(f"has none of the columns {', '.join(COLUMNS)}", file=file, record=where)
    if not isinstance(text, str):
        raise DFlashError(f"is a {type(text).__name__}, not text", file=file, record=where, field="text")
    return tokenizer(text, add_special_tokens=False)["input_ids"] or None


def _records(file: str) -> Iterator[dict[str, Any]]:
    """A record file's records: Parquet in batches (plain Arrow types only), JSONL a line each."""
    if file.lower().endswith(".parquet"):
        import io

        from dflash_ray.arrow_files import open_parquet

        parquet = open_parquet(io.BytesIO(storage.read_bytes(file)), file)
        names = [c for c in COLUMNS + ("output_token_ids",) if c in parquet.schema_arrow.names]
        if not set(names) & set(COLUMNS):
            raise DFlashError(f"has none of the columns {', '.join(COLUMNS)}", file=file)
        for batch in parquet.iter_batches(columns=names, batch_size=1024):
            yield from batch.to_pylist()
        return
    text = storage.read_text(file)
    if file.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise DFlashError(f"not JSON: {e}", file=file) from None
        rows = data if isinstance(data, list) else [data]
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise DFlashError(f"not JSON: {e}", file=file, record=n) from None
    for row in rows:
        if not isinstance(row, dict):
            raise DFlashError(f"a {type(row).__name__}, not a record", file=file)
        yield row


def documents(files: list[str], tokenizer) -> Iterator[list[int]]:
    """Every document of the files (a source's `data_files`), as token ids (empty ones skipped)."""
    for file in files:
        if file.lower().endswith(TEXT_SUFFIXES):
            ids = tokenizer(storage.read_text(file), add_special_tokens=False)["input_ids"]
            if ids:
                yield ids
            continue
        for n, record in enumerate(_records(file)):
            ids = _record_ids(record, tokenizer, file, n)
            if ids:
                yield ids


def packed(docs: Iterable[list[int]], seq_len: int, separator: int) -> Iterator[list[int]]:
    """The documents joined (`separator` after each) and cut into sequences of `seq_len` tokens; the
    tail shorter than that comes last, when it holds two tokens or more."""
    buffer: list[int] = []
    for doc in docs:
        buffer.extend(doc)
        buffer.append(separator)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
    if len(buffer) >= 2:
        yield buffer


def shuffled(sequences: Iterable[list[int]], window: int, rng: random.Random) -> Iterator[list[int]]:
    """The sequences in a seeded order within windows of `window` (1: as they come)."""
    held: list[list[int]] = []
    for seq in sequences:
        held.append(seq)
        if len(held) >= window:
            rng.shuffle(held)
            yield from held
            held = []
    rng.shuffle(held)
    yield from held


class TextStream:
    """Packed sequences from several sources, read again from their start when they run out (an
    epoch each time): `next_batch(n)` gives `n` of them."""

    def __init__(self, sources: list[str], tokenizer, seq_len: int, separator: int, window: int, seed: int):
        self.sources, self.tokenizer, self.seq_len, self.separator = sources, tokenizer, seq_len, separator
        self.window, self.rng = window, random.Random(seed)
        self.epochs, self.tokens_read = 0, 0
        self._it: Iterator[list[int]] = iter(())
        self.epoch_tokens: int | None = None  # the text's tokens as packed, once a whole epoch was read
        self._this_epoch = 0
        # every source's files found and checked (a manifest's sums) once, before a step is taken
        self.files = [f for source in sources for f in data_files(source)]

    def _epoch(self) -> Iterator[list[int]]:
        docs = documents(self.files, self.tokenizer)
        return shuffled(packed(docs, self.seq_len, self.separator), self.window, self.rng)

    def next_batch(self, n: int) -> list[list[int]]:
        batch: list[list[int]] = []
        while len(batch) < n:
            seq = next(self._it, None)
            if seq is None:
                if self.epochs:
                    if not self._this_epoch:
                        raise DFlashError("no text in any source", file=", ".join(self.sources))
                    self.epoch_tokens = self.epoch_tokens or self._this_epoch
                self.epochs, self._this_epoch = self.epochs + 1, 0
                self._it = self._epoch()
                continue
            self._this_epoch += len(seq)
            self.tokens_read += len(seq)
            batch.append(seq)
        return batch
