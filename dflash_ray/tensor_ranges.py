"""Single tensors of a safetensors checkpoint on S3, read by byte ranges.

A drafter needs the target's embedding and LM head (and, with `drafter_init: target`, a few of its
layers): about 5 GB of a 27B target's 54. A safetensors file is an 8-byte header length, a JSON
header with each tensor's dtype, shape and byte offsets, then the data; so a tensor is two small
ranged reads (once a file) and its own bytes (in parallel ranges, `model_fetch.read_ranges`), and
nothing else of the file crosses the network.
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from dflash_ray import model_fetch, storage
from dflash_ray.errors import DFlashError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100 << 20  # safetensors' own bound on a header


def header(uri: str) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets) and where its data begins."""
    n = int.from_bytes(storage.read_range(uri, 0, 8), "little")
    if not 0 < n <= MAX_HEADER:
        raise DFlashError(f"not a safetensors file (a header of {n} bytes)", file=uri)
    try:
        entries = json.loads(storage.read_range(uri, 8, 8 + n))
    except ValueError as e:
        raise DFlashError(f"not a safetensors file (its header is not JSON: {e})", file=uri) from None
    entries.pop("__metadata__", None)
    return entries, 8 + n


def weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> the file of `folder` that holds it (the index, or the one file's header)."""
    index = storage.join(folder, INDEX)
    if storage.exists(index):
        return json.loads(storage.read_text(index))["weight_map"]
    entries, _ = header(storage.join(folder, SINGLE))
    return {name: SINGLE for name in entries}


def read_tensors(folder: str, want: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint in `folder` whose names `want` accepts, each read by its own range."""
    files = weight_map(folder)
    out: dict[str, torch.Tensor] = {}
    for file in sorted({files[k] for k in files if want(k)}):
        uri = storage.join(folder, file)
        entries, data_start = header(uri)
        for name, entry in entries.items():
            if want(name):
                out[name] = _tensor(uri, name, entry, data_start)
    return out


def _tensor(uri: str, name: str, entry: dict, data_start: int) -> torch.Tensor:
    dtype = DTYPES.get(entry.get("dtype", ""))
    if dtype is None:
        raise DFlashError(f"tensor {name}: dtype {entry.get('dtype')!r} is not one safetensors defines", file=uri)
    start, end = entry["data_offsets"]
    data = model_fetch.read_ranges(uri, data_start + start, data_start + end)
    shape = list(entry["shape"])
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)
