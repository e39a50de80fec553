"""Parquet and Arrow files opened only when every column is a plain Arrow type.

An Arrow schema may name an extension type, and a registered one decides how its values turn into
Python: Ray's `ray.data.arrow_pickled_object` unpickles each value, so a Parquet file a user hands
us could run code the moment a row becomes a dict. We write plain types only, so every file we read
goes through `checked`: a column of any extension type (registered or not, at any depth) is refused,
naming the column, before a row is read.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray.errors import DFlashError

EXTENSION_KEY = b"ARROW:extension:name"


def _extension(field: pa.Field) -> str | None:
    """The extension type's name of `field` or of anything nested in it, else None."""
    kind = field.type
    if isinstance(kind, pa.ExtensionType):
        return kind.extension_name
    if field.metadata and EXTENSION_KEY in field.metadata:  # an unregistered one: plain bytes until registered
        return field.metadata[EXTENSION_KEY].decode(errors="replace")
    if pa.types.is_dictionary(kind):
        return _extension(pa.field("value", kind.value_type))
    if pa.types.is_map(kind):
        return _extension(kind.key_field) or _extension(kind.item_field)
    for i in range(kind.num_fields):
        found = _extension(kind.field(i))
        if found:
            return found
    return None


def checked(schema: pa.Schema, uri: str) -> pa.Schema:
    """`schema`, when every column is a plain Arrow type; else the error naming the column."""
    for field in schema:
        name = _extension(field)
        if name:
            raise DFlashError(
                f"column of the Arrow extension type '{name}': only plain Arrow types are read (an "
                "extension type decides how values become Python objects, and a pickled one runs code); "
                "nothing was read: write the column as plain types",
                file=uri,
                field=field.name,
            )
    return schema


def open_parquet(source: Any, uri: str) -> pq.ParquetFile:
    """The Parquet file at `source` (a path, an open file or a buffer) once its schema is checked."""
    f = pq.ParquetFile(source)
    checked(f.schema_arrow, uri)
    return f


def read_parquet(source: Any, uri: str, columns: list[str] | None = None, filesystem: Any = None) -> pa.Table:
    """The whole file (only `columns`, when given) after the schema check; `source` a path on
    `filesystem`, or an open file or buffer."""
    if filesystem is not None:
        with filesystem.open_input_file(source) as f:
            return open_parquet(f, uri).read(columns=columns)
    return open_parquet(source, uri).read(columns=columns)
