"""Checked reads of a drafter's `config.json`: every field a family reads is checked for presence,
type and a sane range before any model is built, and a bad one is a `DFlashError` naming the field
(`dflash_config.mask_token_id` for a nested one), what was expected and what was found.

`export.from_hf_config` reads the fields every family shares (`shared_fields`) and where the mask
token and captured layers sit (`mask_and_layers`); a family's `read_hf_config` reads its own through
`Fields`. The bounds are physical ones (no real target or drafter comes near them), not taste: a
value past one is a typo or a file of something else, which would otherwise fail deep inside the
model's construction or allocate without end. No torch and no Ray here.
"""

from __future__ import annotations

import json
from typing import Any

from dflash_ray.errors import DFlashError

_REQUIRED: Any = object()  # the default of a field that must be there
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # what a drafter's weights may be stored as
LAYER_TYPES = ("full_attention", "sliding_attention")
MAX_WIDTH = 1 << 20  # hidden_size; the widest real models are 16-32k
MAX_INTERMEDIATE = 1 << 22
MAX_HEADS = 1024
MAX_HEAD_DIM = 2048
MAX_LAYERS = 1024  # a drafter's layers, and a target's
MAX_VOCAB = 1 << 24
MAX_BLOCK = 1024
MAX_FEATURES = 64  # captured target layers (`fc` reads hidden_size x this many)
MAX_POSITIONS = 1 << 31
MAX_RANK = 1 << 16  # a family's low-rank heads and codebooks
MAX_PARAMETERS = 1 << 34  # 17e9: past any drafter (a 27B target's is about 2e9)


def parse(raw: str | bytes, file: str) -> dict[str, Any]:
    """A config.json's text as a JSON object: anything else names the file."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bytes that are no text, nesting past any config
        raise DFlashError(f"not valid JSON ({e}): a drafter's config.json is a JSON object", file=file) from None
    if not isinstance(data, dict):
        raise DFlashError(f"expected a JSON object of drafter settings; found {_kind(data)}", file=file)
    return data


def _kind(value: Any) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no layer count


class Fields:
    """One JSON object of a config.json; each read names its key (under `prefix`) when it is bad."""

    def __init__(self, data: Any, prefix: str = ""):
        if not isinstance(data, dict):
            raise DFlashError(f"expected a JSON object; found {_kind(data)}", field=prefix or None)
        self.data, self.prefix = data, prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def bad(self, key: str, expected: str, found: Any) -> DFlashError:
        return DFlashError(f"expected {expected}; found {_kind(found)}", field=self.name(key))

    def get(self, key: str, expected: str, default: Any = _REQUIRED) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise DFlashError(f"missing; expected {expected}", field=self.name(key))
        return default

    def whole(self, key: str, low: int, high: int, default: Any = _REQUIRED, note: str = "") -> int:
        """An integer in low..high (JSON's true or 2.0 is none); `note` says where the bounds come from."""
        expected = f"a whole number in {low}..{high}{note}"
        value = self.get(key, expected, default)
        if value is default and default is not _REQUIRED:
            return value
        if not _is_int(value) or not low <= value <= high:
            raise self.bad(key, expected, value)
        return value

    def real(self, key: str, above: float, high: float) -> float:
        """A number (an integer too) above `above` and at most `high` (NaN and infinity are neither)."""
        expected = f"a number above {above:g} and at most {high:g}"
        value = self.get(key, expected)
        if not (_is_int(value) or isinstance(value, float)) or not above < value <= high:
            raise self.bad(key, expected, value)
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self.get(key, "true or false", default)
        if not isinstance(value, bool):
            raise self.bad(key, "true or false", value)
        return value

    def choice(self, key: str, choices: tuple[Any, ...], default: Any = _REQUIRED) -> Any:
        expected = f"one of {list(choices)}"
        value = self.get(key, expected, default)
        if value is default and default is not _REQUIRED:
            return value
        if type(value) is not type(choices[0]) or value not in choices:  # 1 == True: the type first
            raise self.bad(key, expected, value)
        return value

    def wholes(self, key: str, low: int, high: int, max_len: int, note: str = "") -> list[int]:
        """A list of 1..max_len integers, each in low..high."""
        expected = f"a list of 1 to {max_len} whole numbers in {low}..{high}{note}"
        value = self.get(key, expected)
        if not isinstance(value, list) or not 1 <= len(value) <= max_len:
            raise self.bad(key, expected, value)
        for i, item in enumerate(value):
            if not _is_int(item) or not low <= item <= high:
                raise DFlashError(f"expected {expected}; entry {i} is {_kind(item)}", field=self.name(key))
        return list(value)

    def choices(self, key: str, choices: tuple[str, ...], length: int, note: str = "") -> list[str]:
        """A list of exactly `length` strings, each one of `choices`."""
        expected = f"a list of {length} entries{note}, each one of {list(choices)}"
        value = self.get(key, expected)
        if not isinstance(value, list) or len(value) != length:
            raise self.bad(key, expected, value)
        for i, item in enumerate(value):
            if not isinstance(item, str) or item not in choices:
                raise DFlashError(f"expected {expected}; entry {i} is {_kind(item)}", field=self.name(key))
        return list(value)

    def section(self, key: str) -> "Fields":
        return Fields(self.get(key, "a JSON object"), self.name(key))


def architectures(top: Fields, known: dict[str, str]) -> str:
    """The name of the family whose architecture `architectures` lists (`known`: architecture → family)."""
    value = top.get("architectures", f"a list naming one of {sorted(known)}")
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise top.bad("architectures", "a list of strings", value)
    for name in value:
        if name in known:
            return known[name]
    raise DFlashError(
        f"{value} names no drafter family's model; known: {sorted(known)} (a target model's folder, or "
        "another project's drafter?)",
        field="architectures",
    )


def shared_fields(top: Fields) -> dict[str, Any]:
    """The `DrafterConfig` fields every family's config.json holds, checked in an order where each
    range can rest on the fields before it."""
    num_layers = top.whole("num_hidden_layers", 1, MAX_LAYERS)
    num_heads = top.whole("num_attention_heads", 1, MAX_HEADS)
    num_kv_heads = top.whole("num_key_value_heads", 1, num_heads)
    if num_heads % num_kv_heads:
        raise DFlashError(
            f"{num_kv_heads} does not divide num_attention_heads {num_heads} (grouped-query attention "
            "shares each key/value head among the same number of query heads)",
            field="num_key_value_heads",
        )
    head_dim = top.whole("head_dim", 2, MAX_HEAD_DIM)
    if head_dim % 2:
        raise top.bad("head_dim", "an even number (RoPE rotates halves)", head_dim)
    top.choice("torch_dtype", FLOAT_DTYPES, None)  # not read: the weights' own dtype is; a wrong one is no drafter
    top.choice("dtype", FLOAT_DTYPES, None)  # what newer transformers write for it
    return {
        "hidden_size": top.whole("hidden_size", 1, MAX_WIDTH),
        "intermediate_size": top.whole("intermediate_size", 1, MAX_INTERMEDIATE),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": top.whole("vocab_size", 1, MAX_VOCAB),
        "num_target_layers": top.whole("num_target_layers", 1, MAX_LAYERS),
        "layer_types": top.choices("layer_types", LAYER_TYPES, num_layers, " (one per num_hidden_layers)"),
        "sliding_window": top.whole("sliding_window", 1, MAX_POSITIONS, None) or 2048,  # null: no sliding layers
        "rope_theta": top.real("rope_theta", 0.0, 1e15),
        "rms_norm_eps": top.real("rms_norm_eps", 0.0, 0.5),
        "max_position_embeddings": top.whole("max_position_embeddings", 1, MAX_POSITIONS),
        "block_size": top.whole("block_size", 2, MAX_BLOCK),
        "tie_word_embeddings": top.flag("tie_word_embeddings", False),
    }


def mask_and_layers(top: Fields, nested: bool, shared: dict[str, Any]) -> None:
    """Check the mask token id and the captured target layers, under `dflash_config` (`nested`: a
    family whose config.json has that section) or at the top level, where the family reads them."""
    where = top.section("dflash_config") if nested else top
    vocab, layers = shared["vocab_size"], shared["num_target_layers"]
    where.whole("mask_token_id", 0, vocab - 1, note=f" (a row of the vocab_size {vocab} embedding)")
    where.wholes("target_layer_ids", 0, layers - 1, MAX_FEATURES, f" (layers of the num_target_layers {layers})")
