"""The checkpoint formats that vLLM and SGLang load: `DFlashDraftModel` (vLLM `qwen3_dflash`,
SGLang `dflash`), `DSparkDraftModel` (vLLM `qwen3_dspark`) and `DFlash2DraftModel` (vLLM `qwen3_dflash2`).

`config.json`: Qwen3 fields for the draft layers, `block_size`, `num_target_layers`, `layer_types`,
`sliding_window`, then the family's own fields (`families.Family.hf_config`): for DFlash
`architectures: ["DFlashDraftModel"]` and `dflash_config: {mask_token_id, target_layer_ids}`; a
family with settings also writes them all under `drafter_settings` (its loss weights among them,
which serving ignores), so that the config.json training passes around rebuilds the same drafter.
`model.safetensors`: the drafter's own weights only, under the names of its `state_dict()`
(`fc.weight`, `hidden_norm.weight`, `layers.{i}.…`, `norm.weight`, and a family's heads); the
target's embedding and LM head are shared at serving time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_ray.drafter import config_checks as checks
from dflash_ray.drafter import families, speculators_format
from dflash_ray.drafter.config import DrafterConfig
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    from dflash_ray.drafter.model import DFlashDrafter

CONFIG, WEIGHTS = "config.json", "model.safetensors"
SETTINGS = "drafter_settings"
# keys that make `transformers` import code the config names (with `trust_remote_code`): a drafter
# needs none, and an exported config never carries them on from a checkpoint made elsewhere
REMOTE_CODE = frozenset({"auto_map", "trust_remote_code"})


def to_hf_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """The Qwen3 fields every family shares, then the family's own (architecture, mask id, layer ids)."""
    settings = dataclasses.asdict(cfg.settings)
    return {
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": any(t == "sliding_attention" for t in cfg.layer_types),
        "max_window_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **families.get(cfg.family).hf_config(cfg),
        **({SETTINGS: settings} if settings else {}),
        **{k: v for k, v in cfg.extra.items() if k not in REMOTE_CODE},
    }


def from_hf_config(data: Any, file: str | None = None) -> DrafterConfig:
    """The drafter a serving config.json describes, every field it reads checked first
    (`config_checks`): a missing, mistyped or absurd one is a DFlashError naming `file` and the field,
    before any model is built."""
    try:
        return _from_hf_config(data)
    except DFlashError as e:
        if file is None or e.file is not None:
            raise
        raise DFlashError(e.message, file=file, field=e.field) from None


def _from_hf_config(data: Any) -> DrafterConfig:
    top = checks.Fields(data)
    family = families.get(checks.architectures(top, {families.get(n).architecture: n for n in families.names()}))
    shared = checks.shared_fields(top)
    try:  # where a family reads its own fields: a file of another family misses them
        checks.mask_and_layers(top, "dflash_config" in family.hf_keys, shared)
        own = family.read_hf_config(data)
        saved = families.settings(family.name, top.section(SETTINGS).data if SETTINGS in data else None, SETTINGS)
    except DFlashError as e:
        if not e.message.startswith("missing"):
            raise
        raise DFlashError(f"{e.message} (a {family.architecture} config.json has it)", field=e.field) from None
    own["settings"] = {**dataclasses.asdict(saved), **own.get("settings", {})}  # what serving reads wins
    known = _SHARED_KEYS | family.hf_keys | {SETTINGS}
    try:
        cfg = DrafterConfig(
            **shared, family=family.name, **own, extra={k: v for k, v in data.items() if k not in known}
        )
    except ValueError as e:  # a rule across fields that the checks above leave to the config itself
        raise DFlashError(f"not a drafter this project builds: {e}") from None
    _check_size(cfg)
    return cfg


_SHARED_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "block_size",
        "num_target_layers",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
        "hidden_act",
        "attention_bias",
        "attention_dropout",
        "tie_word_embeddings",
        "torch_dtype",
    }
)


def _check_size(cfg: DrafterConfig) -> None:
    """Sizes each within its bound can still multiply past any drafter: counted on the meta device
    (nothing allocated) before one is built."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in families.get(cfg.family).build(cfg).state_dict().items()}
    total = sum(math.prod(s) for s in shapes.values())
    if total > checks.MAX_PARAMETERS:
        largest = max(shapes, key=lambda k: math.prod(shapes[k]))
        raise DFlashError(
            f"describes a drafter of {total:.3g} parameters, past the {checks.MAX_PARAMETERS:.3g} any drafter has "
            f"(its largest tensor {largest} is {list(shapes[largest])}; num_hidden_layers {cfg.num_layers}, "
            f"intermediate_size {cfg.intermediate_size}, vocab_size {cfg.vocab_size})",
            field="hidden_size",
        )


def read_config(raw: str | bytes, file: str) -> DrafterConfig:
    """A drafter's config.json, from its text: not JSON, or a bad field, names `file`."""
    return from_hf_config(checks.parse(raw, file), file)


def drafter_files(
    drafter: DFlashDrafter, dtype: torch.dtype | None = None, state: dict[str, torch.Tensor] | None = None
) -> dict[str, bytes]:
    """{WEIGHTS: safetensors bytes, CONFIG: JSON bytes}: a copy, taken now, of the weights (`state`:
    the weights to write, when the module's own are sharded)."""
    from safetensors.torch import save

    dtype = dtype or next(drafter.parameters()).dtype
    state = drafter.state_dict() if state is None else state
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    return {
        WEIGHTS: save(tensors, metadata={"format": "pt"}),
        CONFIG: json.dumps(to_hf_config(drafter.cfg, dtype), indent=2).encode(),
    }


def save_drafter(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write config.json + model.safetensors; files land under temporary names, then are renamed
    (`storage.write_bytes`: a full disk leaves no temporary file and names the space needed)."""
    from dflash_ray import storage

    out = Path(out_dir)
    for name, data in drafter_files(drafter, dtype, state).items():
        storage.write_bytes(str(out / name), data)
    return out


def load_drafter(path: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """The drafter of a folder holding config.json and model.safetensors (ours, or a DFlash drafter
    saved by vLLM's speculators trainer: `speculators_format`); a bad config field, or a weight
    missing, unexpected, of another shape or not a float, is a DFlashError naming it."""
    from dflash_ray import weights_files

    path = Path(path)
    config = str(path / CONFIG)
    if not (path / CONFIG).is_file():
        raise DFlashError(f"no {CONFIG}: not a drafter folder", file=str(path))
    data = checks.parse((path / CONFIG).read_bytes(), config)
    theirs = speculators_format.is_speculators(data)
    cfg = from_hf_config(speculators_format.hf_config(data, config) if theirs else data, config)
    drafter = families.get(cfg.family).build(cfg)
    state, weights = weights_files.read_state(str(path))  # shards inside the folder, whole, finite
    if theirs:
        state = speculators_format.our_weights(state, weights)
    _check_weights(state, drafter.state_dict(), weights)
    drafter.to(next(iter(state.values())).dtype)
    drafter.load_state_dict(state)
    return drafter.to(device)


def _check_weights(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], file: str) -> None:
    """Every tensor the config's drafter has, of its shape and a float dtype, and no other."""
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DFlashError(
            f"missing from the weights (the config.json's drafter has it){more}", file=file, field=missing[0]
        )
    for name, tensor in state.items():
        if name not in expected:
            raise DFlashError("a weight the config.json's drafter does not have", file=file, field=name)
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise DFlashError(
                f"shape {list(tensor.shape)}, where the config.json's drafter has {list(want)}", file=file, field=name
            )
        if str(tensor.dtype).removeprefix("torch.") not in checks.FLOAT_DTYPES:
            raise DFlashError(
                f"{str(tensor.dtype).removeprefix('torch.')} weights; expected one of {list(checks.FLOAT_DTYPES)}",
                file=file,
                field=name,
            )


def export_checkpoint(checkpoint: str, out_dir: str, dtype: str = "bfloat16") -> dict:
    """A drafter folder (or a folder holding one under `drafter/`) → the serving format."""
    from dflash_ray import storage
    from dflash_ray.registry import resolve

    if storage.is_s3(checkpoint) and storage.exists(storage.join(checkpoint, "drafter", CONFIG)):
        checkpoint = storage.join(checkpoint, "drafter")  # only that folder is fetched from S3
    source = resolve(checkpoint)
    if (Path(source) / "drafter" / CONFIG).exists():
        source = str(Path(source) / "drafter")
    if not (Path(source) / CONFIG).exists():
        raise DFlashError(f"no {CONFIG}: not a drafter folder or a checkpoint holding one", file=checkpoint)
    return {**export_drafter(load_drafter(source), out_dir, dtype), "checkpoint": checkpoint}


def export_drafter(drafter: DFlashDrafter, out_dir: str, dtype: str = "bfloat16") -> dict:
    """Write `drafter` in the serving format to a local folder or `s3://`; weights that are NaN or
    infinite are refused, naming the first, and nothing is written."""
    from dflash_ray import storage, weights_files

    weights_files.check_finite(dict(drafter.state_dict()), f"the drafter to export to {out_dir}")

    if storage.is_s3(out_dir):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dflash-export-") as local:  # never inside what was read
            save_drafter(drafter, local, dtype=getattr(torch, dtype))
            for name in (WEIGHTS, CONFIG):  # the config last: a reader checks for it
                storage.upload_file(Path(local) / name, storage.join(out_dir, name))
    else:
        save_drafter(drafter, out_dir, dtype=getattr(torch, dtype))
    return {
        "stage": "export",
        "out_dir": out_dir,
        "dtype": dtype,
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "layers": drafter.cfg.num_layers,
        "target_layer_ids": drafter.cfg.target_layer_ids,
    }
