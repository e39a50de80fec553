"""Raw text for `pretrain`, as token ids: any of this project's datasets or a user's own files.

A document is one record (or one plain text file). Per record the first of these it has is read:
`input_ids` (a tokenized dataset: prompt and answer as training sees them), `prompt_token_ids` with
`output_token_ids` (a completions dataset), `messages` (a prompts dataset, or any chat records:
rendered with the target's chat template), `text` (plain text). Documents are joined end to end,
an end-of-text token between two, and cut into sequences of one length: the text's order inside a
sequence is kept, the sequences are shuffled in a seeded window.

Text that is none stops the run before a step where it can, naming the file and the record (line)
and field: a binary file, a record the readers of every stage refuse (`records`), token ids that
are not a list of integers or lie past the target's vocabulary, a dataset of this project made
with another tokenizer (its manifest says which).
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Iterator

from dflash_ray import manifest, storage
from dflash_ray.data import records
from dflash_ray.data.formats import BadRecord
from dflash_ray.data.masking import refuse_outside, token_ids
from dflash_ray.errors import DFlashError

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".parquet", ".jsonl", ".json")
COLUMNS = ("input_ids", "prompt_token_ids", "messages", "text")  # what a record is read from, in this order


def data_files(uri: str) -> list[str]:
    """The files of one source: a dataset of this project (its manifest's files), or a user's file
    or folder of text, JSONL, JSON or Parquet."""
    return manifest.dataset_files(uri, RECORD_SUFFIXES + TEXT_SUFFIXES)


def _ids(values: Any, field: str, vocab: int, file: str, where: int | str) -> list[int]:
    """A record's token ids, refused naming the record when they are none (not a flat list of
    integers) or past the target's vocabulary (a dataset tokenized for another model)."""
    try:
        ids = token_ids(values, field)
        refuse_outside(ids, vocab, field, "the data must be tokenized by the target's own tokenizer")
    except BadRecord as e:
        raise DFlashError(str(e), file=file, record=where, field=field) from None
    return ids.tolist()


def _record_ids(record: dict[str, Any], tokenizer, vocab: int, file: str, where: int | str) -> list[int] | None:
    """One record's token ids, from the first column of `COLUMNS` it has (None: an empty one)."""
    if record.get("input_ids") is not None:
        return _ids(record["input_ids"], "input_ids", vocab, file, where)
    if record.get("prompt_token_ids") is not None:
        prompt = _ids(record["prompt_token_ids"], "prompt_token_ids", vocab, file, where)
        return prompt + _ids(record.get("output_token_ids") or [], "output_token_ids", vocab, file, where)
    if record.get("messages") is not None:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DFlashError("not a list of {role, content} turns", file=file, record=where, field="messages")
        turns = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            rendered = tokenizer.apply_chat_template(turns, tokenize=False)
        except Exception as e:  # jinja errors carry no common base class
            raise DFlashError(f"chat template error: {e}", file=file, record=where, field="messages") from None
        return tokenizer(rendered, add_special_tokens=False)["input_ids"] or None
    text = record.get("text")
    if text is None:
        raise DFlashError(f"has none of the columns {', '.join(COLUMNS)}", file=file, record=where)
    if not isinstance(text, str):
        raise DFlashError(f"is a {type(text).__name__}, not text", file=file, record=where, field="text")
    return tokenizer(text, add_special_tokens=False)["input_ids"] or None


def _records(file: str) -> Iterator[tuple[int | str, dict[str, Any]]]:
    """A record file's records, each with where it is (its line; its row, for Parquet): Parquet in
    batches (plain Arrow types only), JSON and JSONL by the reader every stage uses (`records`),
    which refuses what no record is (bytes that are not UTF-8, nesting past `records.MAX_DEPTH`, a
    key given twice): the first such one stops the run, naming its line."""
    if file.lower().endswith(".parquet"):
        import io

        import pyarrow as pa

        from dflash_ray.arrow_files import open_parquet

        data, row = storage.read_bytes(file), 0
        try:
            parquet = open_parquet(io.BytesIO(data), file)
            names = [c for c in COLUMNS + ("output_token_ids",) if c in parquet.schema_arrow.names]
            if not set(names) & set(COLUMNS):
                raise DFlashError(f"has none of the columns {', '.join(COLUMNS)}", file=file)
            for batch in parquet.iter_batches(columns=names, batch_size=1024):
                for record in batch.to_pylist():
                    row += 1
                    yield row, record
        except (pa.ArrowException, OSError) as e:
            what = "not a readable Parquet file" if row == 0 else f"unreadable after row {row}"
            raise DFlashError(f"{what}: {e}", file=file) from None
        return
    for item in records.iter_records(file):
        where = item.line if item.item is None else f"{item.line} item {item.item}"
        if item.error is not None:
            raise DFlashError(str(item.error), file=file, record=where)
        if not isinstance(item.record, dict):
            raise DFlashError(f"a JSON {type(item.record).__name__}, not a record", file=file, record=where)
        yield where, item.record


def _text_file(file: str) -> str:
    """A plain text file's text, refused when it is not text: bytes that are not UTF-8, or NUL bytes
    (a binary file), naming the line."""
    data = storage.read_bytes(file).removeprefix(records.BOM)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DFlashError(
            f"not UTF-8 text: byte {e.start} ({data[e.start]:#04x}) on line {line} is no UTF-8 character "
            "(a binary file?)",
            file=file,
        ) from None
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise DFlashError(f"not text: a NUL byte on line {line} (a binary file?)", file=file)
    return text


def documents(files: list[str], tokenizer) -> Iterator[list[int]]:
    """Every document of the files (a source's `data_files`), as token ids (empty ones skipped)."""
    vocab = len(tokenizer)
    for file in files:
        if file.lower().endswith(TEXT_SUFFIXES):
            ids = tokenizer(_text_file(file), add_special_tokens=False)["input_ids"]
            if ids:
                yield ids
            continue
        for where, record in _records(file):
            ids = _record_ids(record, tokenizer, vocab, file, where)
            if ids:
                yield ids


def refuse_other_tokenizer(source: str, tokenizer) -> None:
    """Refuse a dataset of this project made with another tokenizer than the target's (its manifest
    names it: a tokenized dataset's `tokenizer`, generated completions' `model`), before a step is
    taken: its token ids would be read in this vocabulary. A tokenizer not at hand here is left to
    each record's own check (`_ids`)."""
    from dflash_ray.registry import load_tokenizer

    made = manifest.read_manifest(source) or {}
    summary = made.get("summary") or {}
    field = {"tokenized": "tokenizer", "completions": "model"}.get(str(made.get("kind")))
    name = summary.get(field) if field else None
    if not isinstance(name, str) or not name:
        return
    try:
        theirs = load_tokenizer(name)
    except (DFlashError, OSError, ValueError):
        return
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise DFlashError(
            f"a {made['kind']} dataset made with the tokenizer of {name!r}, not the target's: its token ids "
            "would be read in another vocabulary; make it again with the target's tokenizer",
            file=source,
            field=f"summary.{field}",
        )


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
        # every source's files found and checked (a manifest's sums and tokenizer) once, before a step is taken
        self.files = [f for source in sources for f in data_files(source)]
        for source in sources:
            refuse_other_tokenizer(source, tokenizer)

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
