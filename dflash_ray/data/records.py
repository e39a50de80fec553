"""Read records one at a time from JSONL, JSON and Parquet files, local or on S3.

A record that cannot be decoded (invalid UTF-8, malformed JSON) comes back with its error instead
of stopping the read, so the caller can quarantine it with its file and line; so does a file that
cannot be read at all (a corrupt Parquet file), as one entry. The readers are tolerant of the
layouts people actually save:
- `.jsonl`: one record per line; a line holding a JSON array of objects yields each of them. A
  file whose first line is not JSON on its own (a pretty-printed array saved as `.jsonl`) is read
  as a JSON document, which reads true JSONL the same way.
- `.jsonl.gz`, `.json.bz2`, `.jsonl.zst`, ...: the same, decompressed; a UTF-8 byte order mark
  at the start of a file is dropped.
- `.json`: a document of top-level values, read value by value: an array yields its elements, an
  object is one record, and several values in a row (a JSONL file saved as `.json`) are each read.
  A broken element is skipped up to its closing bracket and reported alone; the others go on.

A value sound in syntax is refused too, alone, when it is no record this project can use and would
take the run down further on: longer than `MAX_RECORD_BYTES`, nested deeper than `MAX_DEPTH`,
holding an integer longer than Python reads (`sys.get_int_max_str_digits`), or an object that gives
a key twice (`formats.unique_keys`). A JSONL line over the
size that is an array (`json.dump` of a whole list) is read element by element instead.
"""

from __future__ import annotations

import io
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from dflash_ray import storage
from dflash_ray.data.formats import DECODER, BadRecord, loads

COMPRESSIONS = (".gz", ".bz2", ".zst")  # JSON and JSONL files may come compressed
SUFFIXES = (".jsonl", ".json", ".parquet") + tuple(f"{kind}{c}" for kind in (".jsonl", ".json") for c in COMPRESSIONS)
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, as some editors save JSON: not part of the first record
RAW_PREVIEW = 2000  # characters of a bad record kept in quarantine
# One record is one conversation: a million-token one is ~4 MB of text, and its token ids as JSON
# (a completion's) ~7 MB more. A longer record is no conversation a target takes (an embedded file, a
# dump) and costs memory many times its size downstream (a 100 MB prompt took 24 GB in the budget's
# tokenizer, killing the run): it is quarantined unread.
MAX_RECORD_BYTES = 16 * 2**20
# Chat records nest a few levels (a tool schema a dozen or so). Far deeper values reach Python's
# recursion limit in the JSON reader, or later in the encoder and the chat template's `tojson`.
MAX_DEPTH = 100
_WHITESPACE = " \t\n\r"


@dataclass(slots=True)
class RawRecord:
    file: str
    line: int  # 1-based line where the record starts (JSONL, JSON) or row (Parquet)
    record: Any = None
    error: BadRecord | None = None
    raw: str = ""
    item: int | None = None  # 1-based element of the JSON array the record came from

    def where(self) -> dict[str, Any]:
        out = {"file": self.file, "line": self.line}
        if self.item is not None:
            out["item"] = self.item
        return out


def iter_records(uri: str) -> Iterator[RawRecord]:
    low = uri.lower()  # `D.JSONL` is a JSON-lines file too
    if low.endswith(".parquet"):
        yield from _parquet(uri)
        return
    data, name, cut = storage.read_bytes(uri), low, False
    if low.endswith(COMPRESSIONS):
        name = low.rsplit(".", 1)[0]
        try:
            data, cut = _decompress(uri, data)
        except Exception as e:  # corrupt, or a codec this install lacks: one entry
            yield RawRecord(uri, 1, error=BadRecord(f"cannot decompress: {type(e).__name__}: {e}", "corrupt_file"))
            return
    data = data.removeprefix(BOM)
    if cut and not name.endswith(".json"):  # a JSON-lines file cut short: its whole lines are records
        whole, _, _ = data.rpartition(b"\n")
        yield from json_lines(uri, whole)
        lines = whole.count(b"\n") + 1 if whole else 0
        yield RawRecord(
            uri,
            lines + 1,
            error=BadRecord(
                f"the compressed file ends mid-stream after line {lines}: the records past it are lost "
                "(a partial download or copy?)",
                "truncated_file",
            ),
        )
    elif cut:
        yield RawRecord(uri, 1, error=BadRecord("the compressed file ends mid-stream: cut short", "truncated_file"))
    elif name.endswith(".json"):
        yield from json_document(uri, data)
    else:
        yield from json_lines(uri, data)


def _decompress(uri: str, data: bytes) -> tuple[bytes, bool]:
    """The bytes, and whether the stream was cut short (the bytes then are what came before the cut)."""
    uri = uri.lower()
    if uri.endswith((".gz", ".bz2")):
        import bz2
        import zlib

        parts = []
        while data:  # member by member (`cat a.gz b.gz` is one gzip file)
            codec = zlib.decompressobj(wbits=31) if uri.endswith(".gz") else bz2.BZ2Decompressor()
            parts.append(codec.decompress(data))
            if not codec.eof:
                return b"".join(parts), True
            data = codec.unused_data
        return b"".join(parts), False
    import zstandard

    parts, context = [], zstandard.ZstdDecompressor()
    while data:  # frame by frame: `zstd` may write several, and a cut frame must not pass as a short file
        frame = context.decompressobj()
        parts.append(frame.decompress(data))
        if not frame.eof:
            return b"".join(parts), True
        data = frame.unused_data
    return b"".join(parts), False


def json_lines(uri: str, data: bytes, sniff: bool = True) -> Iterator[RawRecord]:
    """JSONL: one record per line (or a line's array of objects)."""
    first = sniff
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            first = False
            yield RawRecord(
                uri,
                number,
                error=BadRecord(f"invalid UTF-8 at byte {e.start}", "invalid_utf8"),
                raw=line[:RAW_PREVIEW].decode("utf-8", "replace"),
            )
            continue
        if len(line) > MAX_RECORD_BYTES:
            first = False
            if text.lstrip().startswith("["):  # a whole list dumped on one line: its elements are the records
                yield from _document(uri, text, number)
            else:
                yield RawRecord(uri, number, error=_too_large(len(line)), raw=text[:RAW_PREVIEW])
            continue
        try:
            value, _ = _read(text)
        except json.JSONDecodeError as e:
            if first and _is_utf8(data):  # a JSON document under a .jsonl name?
                yield from json_document(uri, data)
                return
            yield RawRecord(
                uri,
                number,
                error=BadRecord(f"malformed JSON: {e.msg} (column {e.colno})", "malformed_json"),
                raw=text[:RAW_PREVIEW],
            )
            first = False
            continue
        except BadRecord as e:
            first = False
            yield RawRecord(uri, number, error=e, raw=text[:RAW_PREVIEW])
            continue
        first = False
        if (error := _refused(text, 0, len(text), value)) is not None:
            yield RawRecord(uri, number, error=error, raw=text[:RAW_PREVIEW])
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item, record in enumerate(value, start=1):
                yield RawRecord(uri, number, record=record, item=item)
        else:
            yield RawRecord(uri, number, record=value, raw=text)


def _read(text: str, start: int | None = None) -> tuple[Any, int]:
    """The JSON value of `text` (at `start`: the value there, as `raw_decode`) and its end offset.
    Raises `JSONDecodeError` for broken syntax, `BadRecord` for a value the reader cannot make:
    nested past Python's recursion limit, an integer longer than Python reads, a key given twice."""
    try:
        if start is None:
            return loads(text), len(text)
        return DECODER.raw_decode(text, start)
    except RecursionError:
        raise _too_deep() from None
    except (json.JSONDecodeError, BadRecord):
        raise
    except ValueError as e:  # int(): "Exceeds the limit (4300 digits) for integer string conversion ..."
        digits = re.search(r"has (\d+) digits", str(e))
        raise BadRecord(
            f"an integer of {digits[1] if digits else 'too many'} digits, longer than Python reads "
            f"({sys.get_int_max_str_digits()} at most): no chat record holds one",
            "number_too_long",
        ) from None


def _refused(text: str, start: int, end: int, value: Any) -> BadRecord | None:
    """Why a decoded value at `text[start:end]` is refused: too large, or nested too deeply."""
    size = end - start
    if size > MAX_RECORD_BYTES // 4:  # a character is 4 bytes at most: encode only the large
        size = len(text[start:end].encode("utf-8", "surrogatepass"))
    if size > MAX_RECORD_BYTES:
        return _too_large(size)
    if text.count("[", start, end) + text.count("{", start, end) > MAX_DEPTH and _deeper(value, MAX_DEPTH):
        return _too_deep()
    return None


def _deeper(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels in `value` (without recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _too_large(size: int) -> BadRecord:
    return BadRecord(
        f"a record of {size:,} bytes, over the {MAX_RECORD_BYTES:,} a record may have "
        "(records.MAX_RECORD_BYTES): longer than any conversation a target takes (an embedded file, a dump?)",
        "record_too_large",
    )


def _too_deep() -> BadRecord:
    return BadRecord(
        f"lists and objects nested more than {MAX_DEPTH} levels deep (records.MAX_DEPTH): no chat record nests so",
        "nested_too_deep",
    )


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


class _Lines:
    """1-based line of a text offset; offsets are asked in increasing order."""

    def __init__(self, text: str, first: int = 1):
        self.text, self.pos, self.line = text, 0, first

    def at(self, pos: int) -> int:
        self.line += self.text.count("\n", self.pos, pos)
        self.pos = pos
        return self.line


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _element_end(text: str, start: int) -> int:
    """Offset of the `,` or `]` that closes the array element starting at `start`.

    Brackets are matched outside strings; a closing bracket that matches no open one is taken for
    the element's typo and passed over. A raw newline ends a string (JSON strings cannot hold one),
    so an unterminated quote swallows one line at most. The end of the text when the brackets
    never balance.
    """
    stack: list[str] = []
    in_string, escaped = False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch in '"\n':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if stack and stack[-1] == ch:
                stack.pop()
            elif not stack and ch == "]":
                return i
        elif ch == "," and not stack:
            return i
    return len(text)


def _next_line_element(text: str, start: int, decoder: json.JSONDecoder) -> int:
    """Offset of the first later line that opens a whole element (for a broken element whose
    brackets never balance), or the end of the text."""
    pos = text.find("\n", start)
    while pos >= 0:
        q = pos + 1
        while q < len(text) and text[q] in " \t":
            q += 1
        if q < len(text) and text[q] in "{[":
            try:
                end = _skip(text, decoder.raw_decode(text, q)[1])
                if end >= len(text) or text[end] in ",]":
                    return q
            except json.JSONDecodeError:
                pass
            except (ValueError, RecursionError):  # one the reader refuses: read (and refused) as itself
                return q
        pos = text.find("\n", q)
    return len(text)


def _malformed(
    uri: str, line: int, e: json.JSONDecodeError, raw: str, item: int | None = None, above: int = 0
) -> RawRecord:
    """`above`: the lines of the file above the text `e` was raised in."""
    return RawRecord(
        uri,
        line,
        error=BadRecord(f"malformed JSON: {e.msg} (line {e.lineno + above}, column {e.colno})", "malformed_json"),
        raw=raw[:RAW_PREVIEW],
        item=item,
    )


def json_document(uri: str, data: bytes) -> Iterator[RawRecord]:
    """A JSON document read value by value (see the module docstring)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # bad bytes: read it line by line, so only their lines are lost
        yield from json_lines(uri, data, sniff=False)
        return
    yield from _document(uri, text, 1)


def _document(uri: str, text: str, first_line: int) -> Iterator[RawRecord]:
    """The values of `text`, which starts on line `first_line` of `uri`: a top-level array's
    elements each, other top-level values whole."""
    lines, pos, n = _Lines(text, first_line), 0, len(text)
    while (pos := _skip(text, pos)) < n:
        if text[pos] != "[":
            try:
                read, end = _value(uri, text, pos, lines.at(pos))
            except (json.JSONDecodeError, BadRecord) as e:  # a top-level value: resume on the next line
                end = text.find("\n", pos)
                end = n if end < 0 else end
                read = _unread(uri, lines.at(pos), e, text[pos:end], None, first_line - 1)
            yield read
            pos = end
            continue
        pos, item = pos + 1, 0
        while (pos := _skip(text, pos)) < n and text[pos] != "]":
            item += 1
            try:
                read, end = _value(uri, text, pos, lines.at(pos), item)
            except (json.JSONDecodeError, BadRecord) as e:
                end = _element_end(text, pos)
                if end == len(text):  # its brackets never balance: resume at a later whole element
                    end = _next_line_element(text, pos, DECODER)
                end = max(end, pos + 1)
                read = _unread(uri, lines.at(pos), e, text[pos:end], item, first_line - 1)
            yield read
            pos = _skip(text, end)
            if pos < n and text[pos] == ",":
                pos += 1
        pos += 1  # past the closing bracket (an unclosed array just ends with the text)


def _value(uri: str, text: str, pos: int, line: int, item: int | None = None) -> tuple[RawRecord, int]:
    """The value at `pos`, or its refusal (too large, too deep), and its end; raises as `_read`."""
    value, end = _read(text, pos)
    error = _refused(text, pos, end, value)
    if error is None:
        return RawRecord(uri, line, record=value, item=item), end
    return RawRecord(uri, line, error=error, raw=text[pos : pos + RAW_PREVIEW], item=item), end


def _unread(
    uri: str, line: int, e: json.JSONDecodeError | BadRecord, raw: str, item: int | None, above: int
) -> RawRecord:
    if isinstance(e, json.JSONDecodeError):
        return _malformed(uri, line, e, raw, item, above)
    return RawRecord(uri, line, error=e, raw=raw[:RAW_PREVIEW], item=item)


def _parquet(uri: str) -> Iterator[RawRecord]:
    import pyarrow as pa

    from dflash_ray.arrow_files import open_parquet

    data, number = storage.read_bytes(uri), 0
    try:
        for batch in open_parquet(io.BytesIO(data), uri).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield RawRecord(uri, number, record=arrow_row(row))
    except (pa.ArrowException, OSError) as e:  # corrupt or truncated: the file's rest is one entry
        what = "not a readable Parquet file" if number == 0 else f"unreadable after row {number}"
        yield RawRecord(uri, number + 1, error=BadRecord(f"{what}: {e}", "corrupt_file"))


def arrow_row(value: Any) -> Any:
    """A row read through Arrow as the record it was written from: Arrow gives every row every key
    of its column's struct type, None where the row had none, which would read as a field present
    and null (a ShareGPT row with a null `messages` column beside its `conversations`, a tool schema
    with every other tool's parameters). Keys whose value is None are dropped, at every depth."""
    if isinstance(value, dict):
        return {k: arrow_row(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [arrow_row(v) for v in value]
    return value


def raw_preview(item: RawRecord) -> str:
    if item.raw:
        return item.raw[:RAW_PREVIEW]
    if item.record is None:
        return ""
    try:
        return json.dumps(item.record, ensure_ascii=False, default=str)[:RAW_PREVIEW]
    except (TypeError, ValueError):
        return repr(item.record)[:RAW_PREVIEW]
    except RecursionError:  # a Parquet or Hub row nested past the encoder: its place names it
        return ""
