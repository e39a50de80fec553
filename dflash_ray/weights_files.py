"""Weights read from a folder the run did not write (a warm-start drafter, a drafter folder to export
or evaluate), read in one place with every check a reader needs.

A folder holds `model.safetensors` or shards listed by `model.safetensors.index.json`. Every file an
index names must stay inside the folder (`storage.inside`: nothing outside is opened) and be there;
each file must be safetensors (a pickle, `torch.save`'s zip or `pytorch_model.bin` is refused
unopened: unpickling runs code), whole (its header's byte ranges inside the file) and finite (a NaN
or infinite weight trains or serves garbage). A run checks these on the driver before any actor
starts (`train.shape.drafter_init`), so a bad start is named with its file and field, not found by
every actor after Ray starts and blamed on the restarts.
"""

from __future__ import annotations

import json
import struct

import torch

from dflash_ray import storage
from dflash_ray.errors import DFlashError

WEIGHTS = "model.safetensors"
INDEX = WEIGHTS + ".index.json"  # a model saved in shards: which file holds each weight
PICKLED = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth")
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def weight_files(folder: str, field: str | None = None) -> tuple[list[str], str]:
    """The safetensors files of `folder` and the file that lists them (the index, or the single file)."""
    single, index = storage.join(folder, WEIGHTS), storage.join(folder, INDEX)
    if storage.exists(single):
        return [single], single
    if not storage.exists(index):
        pickled = [name for name in PICKLED if storage.exists(storage.join(folder, name))]
        held = f"; it holds {pickled[0]}, a pickle, which is never opened (unpickling runs code)" if pickled else ""
        raise DFlashError(
            f"no {WEIGHTS} nor {INDEX}{held}: weights are read from safetensors only (convert them with "
            "safetensors' save_file)",
            file=folder,
            field=field,
        )
    try:
        weight_map = json.loads(storage.read_text(index))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise DFlashError(f"not a safetensors index with a weight_map ({e!r})", file=index, field=field) from None
    if not names or not all(isinstance(n, str) for n in names):
        raise DFlashError("its weight_map lists no file names", file=index, field="weight_map")
    files = [storage.inside(folder, name, file=index, field="weight_map") for name in names]
    for file in files:
        if not storage.exists(file):
            raise DFlashError(f"missing: {INDEX} lists it and it is not in the folder", file=file, field=field)
    return files, index


def check_safetensors(data: bytes, file: str) -> None:
    """Refuse bytes that are not one whole safetensors file, before safetensors parses them."""
    (length,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
    if data[8:9] != b"{" and (data[:2] == b"PK" or (data[:1] == b"\x80" and data[1:2] in b"\x02\x03\x04\x05")):
        raise DFlashError(
            "a pickle (torch.save) where safetensors goes: never opened (unpickling runs code); save it "
            "with safetensors",
            file=file,
        )
    if len(data) < 8:
        raise DFlashError(f"not a readable safetensors file: {len(data)} bytes (cut short?)", file=file)
    if length > min(MAX_HEADER, len(data) - 8):
        raise DFlashError(
            f"not a readable safetensors file: a header of {length} bytes in a file of {len(data)} (cut short?)",
            file=file,
        )
    try:
        header = json.loads(data[8 : 8 + length])
    except (ValueError, UnicodeDecodeError):
        raise DFlashError("not a readable safetensors file: its header is not JSON (damaged?)", file=file) from None
    if not isinstance(header, dict):
        raise DFlashError("not a readable safetensors file: its header is not a mapping", file=file)
    body = len(data) - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise DFlashError(
                "not a readable safetensors file: no data_offsets in its header", file=file, field=str(name)
            )
        if not 0 <= offsets[0] <= offsets[1] <= body:
            raise DFlashError(
                f"not a readable safetensors file: its bytes {offsets} lie past the file's {body} (cut short?)",
                file=file,
                field=str(name),
            )


def check_finite(state: dict[str, torch.Tensor], file: str) -> None:
    """Refuse a floating-point weight holding NaN or infinity, naming the first."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise DFlashError(
                f"{bad} of its {tensor.numel()} values are NaN or infinite: weights that would train or serve garbage",
                file=file,
                field=name,
            )


def read_file(file: str) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors, every check of `check_safetensors` and `check_finite` passed."""
    from safetensors.torch import load

    data = storage.read_bytes(file)
    check_safetensors(data, file)
    try:
        state = load(data)
    except Exception as e:  # safetensors' own error: a damaged file its header check let through
        if type(e).__name__ != "SafetensorError":
            raise
        raise DFlashError(f"not a readable safetensors file ({e})", file=file) from None
    check_finite(state, file)
    return state


def read_state(folder: str, field: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """Every weight of the folder (`model.safetensors`, or the shards its index lists), checked;
    and the file to name in a later error (the index, or the single file)."""
    files, listed_by = weight_files(folder, field)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in read_file(file).items():
            if name in state:
                raise DFlashError("a weight two shards both hold", file=file, field=name)
            state[name] = tensor
    return state, listed_by
