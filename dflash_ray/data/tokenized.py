"""Read a tokenized dataset in any of the layouts people keep one in, for validation and training.

Layouts, local or on S3:
- one Parquet file, or one Arrow file;
- a folder written by `dflash-ray tokenize` (its `_manifest.json` lists the files);
- a folder of Parquet files without a manifest (read whole);
- a Hugging Face dataset saved with `Dataset.save_to_disk`: Arrow IPC stream files
  (`data-00000-of-0000N.arrow`), listed in `state.json`, beside `dataset_info.json`.

`input_ids` and `loss_mask` (lists of integers, or booleans for the mask) are required; `seq_len`,
`id` and `source` are optional. A file without a required column, a file that cannot be read, or a
dataset of prompts or completions (not tokenized yet) is refused with a message naming the file,
the column and the command that makes a tokenized dataset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray import manifest, storage
from dflash_ray.arrow_files import checked, open_parquet
from dflash_ray.data.formats import BadRecord, loads
from dflash_ray.errors import DFlashError

REQUIRED = ("input_ids", "loss_mask")
OPTIONAL = ("seq_len", "id", "source")
DATA_SUFFIXES = (".parquet", ".arrow")
HF_STATE = "state.json"  # `save_to_disk`: lists the Arrow files
TOKENIZE_HINT = "make one from completions with `dflash-ray tokenize --input COMPLETIONS --output DIR`"
NOT_TOKENIZED = {
    "prompts": "holds prompts, not tokenized samples: generate completions with `dflash-ray generate "
    "--prompts URI`, then tokenize them with `dflash-ray tokenize`",
    "completions": "holds completions, not tokenized samples yet: tokenize them with "
    "`dflash-ray tokenize --input URI --output DIR`",
}


@dataclass(frozen=True, slots=True)
class TokenizedData:
    uri: str
    files: list[str]
    columns: frozenset[str]  # the optional columns every file has, and the required ones
    made_by: dict[str, Any] | None  # the manifest, when this project wrote the dataset

    def row_counts(self) -> list[int]:
        if self.made_by is not None:
            rows = {storage.join(self.uri, e["name"]): int(e["rows"]) for e in self.made_by["files"]}
            return [rows[f] for f in self.files]
        return [_num_rows(f) for f in self.files]


def _is_file(uri: str) -> bool:
    return storage.exists(uri) if storage.is_s3(uri) else storage.local_path(uri).is_file()


def _hf_arrow_files(folder: str) -> list[str]:
    state = storage.join(folder, HF_STATE)
    if storage.exists(state):
        try:
            names = [f["filename"] for f in loads(storage.read_text(state))["_data_files"]]
        except (json.JSONDecodeError, BadRecord, KeyError, TypeError) as e:
            raise DFlashError(f"not a `save_to_disk` state file ({type(e).__name__}: {e})", file=state) from None
        return [storage.inside(folder, n, file=state, field=f"_data_files[{i}].filename") for i, n in enumerate(names)]
    return storage.list_files(folder, ".arrow")


def _data_files(uri: str) -> tuple[list[str], dict[str, Any] | None]:
    if not storage.is_s3(uri) and not storage.local_path(uri).exists():
        raise DFlashError("no such file or folder", file=uri)
    if _is_file(uri):
        if uri.endswith(DATA_SUFFIXES):
            return [uri], None
        if uri.endswith((".jsonl", ".json")):
            raise DFlashError(
                f"a JSON file holds records, not a tokenized dataset (Parquet or Arrow with "
                f"{' and '.join(REQUIRED)}): {TOKENIZE_HINT}",
                file=uri,
            )
        raise DFlashError("not a tokenized dataset: expected a .parquet or .arrow file, or a folder of them", file=uri)
    made_by = manifest.read_manifest(uri)
    if made_by is not None:
        kind = str(made_by.get("kind"))
        if kind.startswith("prompts") or kind == "completions":  # prompts-jsonl: `selfprompt`'s chats
            raise DFlashError(NOT_TOKENIZED["completions" if kind == "completions" else "prompts"], file=uri)
        files = manifest.dataset_files(uri, DATA_SUFFIXES)
        other = [f for f in files if not f.endswith(DATA_SUFFIXES)]
        if other:
            raise DFlashError(f"a '{kind}' dataset, not a tokenized one: {TOKENIZE_HINT}", file=other[0])
        return files, made_by
    manifest.refuse_split_dict(uri)
    files = storage.list_files(uri, ".parquet") or _hf_arrow_files(uri)
    if not files:
        found = "JSON files, not a tokenized dataset: " if storage.list_files(uri, (".jsonl", ".json")) else ""
        raise DFlashError(
            f"{found}no Parquet or Arrow files with {' and '.join(REQUIRED)} here; {TOKENIZE_HINT}", file=uri
        )
    return files, None


def _arrow_reader(f):
    """Arrow IPC as `save_to_disk` writes it (stream format), or the file format."""
    try:
        return pa.ipc.open_stream(f)
    except pa.ArrowInvalid:
        f.seek(0)
        return pa.ipc.open_file(f)


def _batches(reader) -> Iterator[pa.RecordBatch]:
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def _schema(uri: str) -> pa.Schema:
    fs, path = storage.arrow_filesystem(uri)
    try:
        with fs.open_input_file(path) as f:
            schema = _arrow_reader(f).schema if uri.endswith(".arrow") else pq.ParquetFile(f).schema_arrow
    except (pa.ArrowException, OSError) as e:
        kind = "Arrow" if uri.endswith(".arrow") else "Parquet"
        raise DFlashError(f"not a readable {kind} file: {e}", file=uri) from None
    return checked(schema, uri)


def _check_columns(uri: str, names: set[str]) -> None:
    missing = [c for c in REQUIRED if c not in names]
    if not missing:
        return
    if "messages" in names:
        kind = "completions" if names & {"text", "output_token_ids"} else "prompts"
        raise DFlashError(NOT_TOKENIZED[kind], file=uri)
    raise DFlashError(
        f"missing column: a tokenized dataset needs {' and '.join(REQUIRED)} (columns here: "
        f"{', '.join(sorted(names)) or 'none'})",
        file=uri,
        field=missing[0],
    )


def _check_types(uri: str, schema: pa.Schema) -> None:
    """`input_ids` a list of integers, `loss_mask` a list of integers or booleans: floats (a token id
    of 1.7, a mask of 0.5), strings or scalars are refused before any value is read or cast."""
    for name, ok, allowed in (
        ("input_ids", pa.types.is_integer, "integers"),
        ("loss_mask", lambda t: pa.types.is_integer(t) or pa.types.is_boolean(t), "integers 0/1 or booleans"),
    ):
        kind = schema.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not ok(kind.value_type):
            raise DFlashError(f"holds {kind}, not a list of {allowed} per sample", file=uri, field=name)


def open_tokenized(uri: str) -> TokenizedData:
    """The files of the tokenized dataset at `uri`, each checked for the required columns and their types."""
    uri = str(uri)
    files, made_by = _data_files(uri)
    columns = set(REQUIRED) | set(OPTIONAL)
    for f in files:
        schema = _schema(f)
        names = set(schema.names)
        _check_columns(f, names)
        _check_types(f, schema)
        columns &= names
    return TokenizedData(uri, files, frozenset(columns), made_by)


def iter_batches(uri: str, columns: list[str], batch_size: int = 4096) -> Iterator[pa.RecordBatch]:
    """The file's record batches with only `columns`."""
    fs, path = storage.arrow_filesystem(uri)
    try:
        with fs.open_input_file(path) as f:
            if uri.endswith(".arrow"):
                reader = _arrow_reader(f)
                checked(reader.schema, uri)
                for batch in _batches(reader):
                    yield batch.select(columns)
            else:
                yield from open_parquet(f, uri).iter_batches(batch_size=batch_size, columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise DFlashError(f"unreadable: {e}", file=uri) from None


def read_table(uri: str, columns: list[str]) -> pa.Table:
    """The whole file with only `columns`."""
    batches = list(iter_batches(uri, columns))
    if batches:
        return pa.Table.from_batches(batches)
    return pa.Table.from_batches([], schema=pa.schema([_schema(uri).field(c) for c in columns]))


def _num_rows(uri: str) -> int:
    if uri.endswith(".arrow"):
        return sum(b.num_rows for b in iter_batches(uri, []))
    fs, path = storage.arrow_filesystem(uri)
    with fs.open_input_file(path) as f:
        return pq.ParquetFile(f).metadata.num_rows


DIGEST_BYTES = 16


def sample_digest(input_ids: np.ndarray, loss_mask: np.ndarray) -> bytes:
    """What a sample is, in 16 bytes: the same tokens under the same mask give the same digest."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(np.asarray(input_ids, dtype=np.int32).tobytes())
    h.update(b"|")
    h.update(np.asarray(loss_mask, dtype=np.int8).tobytes())
    return h.digest()


def first_copies(digests: np.ndarray) -> np.ndarray:
    """For each sample (a row of `digests`, in dataset order), the index of the first sample with its
    content: itself when it is the first, an earlier one when it is a copy."""
    if not len(digests):
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(digests, axis=0, return_index=True, return_inverse=True)
    return first[inverse.reshape(-1)]
