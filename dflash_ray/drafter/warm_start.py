"""A run that starts from a released drafter (`train.init_from`: an exported folder, local or S3, or
a Hugging Face Hub id, `ORG/NAME[@REVISION]`, fetched into each node's Hub cache where it is read).

Most teams adapt a published drafter to their own traffic rather than train one from nothing. What
must agree is what the weights mean: every tensor's shape (the drafter's width, depth, heads, MLP,
vocabulary and the captured layers' count), the mask token's row and which target layers the
features come from; a different `block_size` is free (the weights do not depend on it). A DSpark or
DFlash2 run may start from a plain DFlash drafter: the backbone is loaded, the family's own heads
start fresh. The optimizer always starts fresh; the rate warms up over `train.warmup_ratio`. A DFlash
drafter saved by vLLM's speculators trainer starts a run too (`speculators_format`).
"""

from __future__ import annotations

import torch

from dflash_ray import storage
from dflash_ray.drafter import config_checks, families, speculators_format
from dflash_ray.drafter.config import DrafterConfig
from dflash_ray.drafter.export import CONFIG, from_hf_config
from dflash_ray.errors import DFlashError

PREFIX = "drafter:"  # the start mode that names a released drafter's folder (`initial_drafter`)

# (the run's setting, the drafter config's field) that must match the released drafter's
MUST_MATCH = (
    ("train.num_layers", "num_layers"),
    ("train.num_heads", "num_heads"),
    ("train.num_kv_heads", "num_kv_heads"),
    ("train.head_dim", "head_dim"),
    ("train.intermediate_size", "intermediate_size"),
    ("train.layer_types", "layer_types"),
    ("train.num_target_features", "target_layer_ids"),
    ("train.target_layer_ids", "target_layer_ids"),
    ("train.mask_token_id", "mask_token_id"),
)


def released_config(folder: str, num_target_layers: int | None = None) -> DrafterConfig:
    """The released drafter's config, every field checked (a bad one names the file and field).
    `num_target_layers`: the run's target's, which a speculators config.json does not hold."""
    return _read_config(folder, num_target_layers)[0]


def located(folder: str) -> str:
    """Where the released drafter's files are read: the folder itself (local or `s3://`), or a Hub
    id's snapshot in this node's Hugging Face cache (fetched once; offline, the cache must hold it)."""
    from dflash_ray.registry import HUB_ID, resolve

    if storage.is_s3(folder) or storage.local_path(folder).exists() or not HUB_ID.match(folder):
        return folder
    return resolve(folder)


def _read_config(folder: str, num_target_layers: int | None) -> tuple[DrafterConfig, bool]:
    """The config, and whether vLLM's speculators trainer wrote the folder (its weight names then)."""
    uri = storage.join(located(folder), CONFIG)
    if not storage.exists(uri):
        raise DFlashError("no exported drafter here (no config.json)", file=folder, field="train.init_from")
    data = config_checks.parse(storage.read_bytes(uri), uri)
    theirs = speculators_format.is_speculators(data)
    return from_hf_config(speculators_format.hf_config(data, uri, num_target_layers) if theirs else data, uri), theirs


def check_fits(released: DrafterConfig, run: DrafterConfig, folder: str) -> None:
    """Refuse a released drafter whose weights mean something else in this run, naming the setting."""
    if (released.hidden_size, released.vocab_size) != (run.hidden_size, run.vocab_size):
        raise DFlashError(
            f"a drafter of a target with hidden_size {released.hidden_size} and vocab_size {released.vocab_size}; "
            f"this run's target has {run.hidden_size} and {run.vocab_size}: its weights cannot start this run",
            file=folder,
            field="train.init_from",
        )
    for setting, name in MUST_MATCH:
        theirs, ours = getattr(released, name), getattr(run, name)
        if name == "target_layer_ids" and setting == "train.num_target_features":
            theirs, ours = len(theirs), len(ours)
        if theirs != ours:
            raise DFlashError(
                f"{theirs!r} in the released drafter, {ours!r} in this run: its weights would be read as "
                f"another {name}; set {setting} to the released drafter's, or start from another",
                file=folder,
                field=setting,
            )
    if released.family != run.family and released.family != "dflash":
        raise DFlashError(
            f"a {released.family!r} drafter; a {run.family!r} run starts from its own family or a plain "
            "DFlash drafter (whose backbone it keeps, its own heads fresh)",
            file=folder,
            field="train.drafter",
        )


def read_weights(folder: str) -> tuple[dict[str, torch.Tensor], str]:
    """The released drafter's weights, from `model.safetensors` or the shards its index lists, each
    file checked (`weights_files`); and the file (or index) to name in an error."""
    from dflash_ray import weights_files

    return weights_files.read_state(folder, field="train.init_from")


def matched_state(cfg: DrafterConfig, folder: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The released drafter's weights under this run's names, each of the shape this run's drafter
    (`cfg`) gives it, and the names that start fresh (a family's own heads over a plain DFlash
    backbone). Checked on the driver before any actor starts (`check_weights`), read again by each."""
    folder = located(folder)  # a Hub id looked up once: the config and the weights from one snapshot
    released, theirs = _read_config(folder, cfg.num_target_layers)
    state, uri = read_weights(folder)
    if theirs:
        state = speculators_format.our_weights(state, uri)
    with torch.device("meta"):  # names and shapes only
        own = families.get(cfg.family).build(cfg).state_dict()
        if released.family != cfg.family:  # a plain DFlash backbone: its names
            backbone = set(families.get("dflash").build(released).state_dict())
        else:
            backbone = set(own)
    fresh = sorted(k for k in own if k not in state)
    if set(fresh) - (set(own) - backbone) or set(state) - set(own):
        name = next(iter(sorted(set(fresh) - (set(own) - backbone)) or sorted(set(state) - set(own))))
        raise DFlashError("a weight the released drafter and this run's do not share", file=uri, field=name)
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise DFlashError(
                f"shape {list(tensor.shape)}, this run's drafter has {list(own[name].shape)}", file=uri, field=name
            )
    return state, fresh


def check_weights(cfg: DrafterConfig, folder: str) -> None:
    """Every file of the released drafter present, whole, safetensors and finite, and every weight of
    this run's names and shapes: on the driver, before any actor starts."""
    matched_state(cfg, folder)


def load_released(drafter: torch.nn.Module, cfg: DrafterConfig, folder: str) -> list[str]:
    """Copy the released drafter's weights into `drafter` (built for this run); returns the names
    that start fresh (a family's own heads over a plain DFlash backbone)."""
    state, fresh = matched_state(cfg, folder)
    own = drafter.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.to(own[name].dtype))
    return fresh
