"""Context features from a frozen target: forward hooks on the chosen decoder layers.

A layer index means one thing everywhere: `i` is the OUTPUT of 0-based decoder layer `i`, which
is Hugging Face's `output_hidden_states[i + 1]` (except after the last layer, where HF applies the
final norm). The forward stops right after the deepest captured layer: no later layer and no LM
head over the sequence is ever computed.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, cast

import torch
from torch import nn

from dflash_ray import progress
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _StopForward(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a HF causal LM (Llama, Qwen3, Qwen3.5 hybrid, multimodal wrappers)."""
    for path in ("model.layers", "model.language_model.layers", "language_model.model.layers", "layers"):
        module: nn.Module | None = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList):
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


@contextmanager
def capture(
    model: nn.Module, layer_ids: list[int], *, stop_after_last: bool = True
) -> Iterator[dict[int, torch.Tensor]]:
    """Hooks that record each chosen layer's output; removed on exit whatever happens."""
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer ids {bad} outside the target's {len(layers)} layers")
    captured: dict[int, torch.Tensor] = {}
    deepest = max(layer_ids)

    def hook_for(i: int):
        def hook(_module, _inputs, output):
            captured[i] = output[0] if isinstance(output, tuple) else output
            if stop_after_last and i == deepest:
                raise _StopForward

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(layer_ids))]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def target_features(
    model: nn.Module, input_ids: torch.Tensor, layer_ids: list[int], attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, S, n*H]: the chosen layers' outputs, concatenated in `layer_ids` order."""
    return target_outputs(model, input_ids, layer_ids, attention_mask)[0]


@torch.no_grad()
def target_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer_ids: list[int],
    attention_mask: torch.Tensor | None = None,
    *,
    top_k: int = 0,
    want_BS: torch.Tensor | None = None,
    max_chunk_bytes: int = 256 * 1024**2,
    last_hidden: bool = False,
):
    """The features, and with `top_k > 0` the target's own next-token distribution as its top-k:
    ids [B, S, k] and probabilities [B, S, k] (float32; softmax over the whole vocabulary, so a row
    sums to at most 1) at the positions `want_BS` marks (zeros elsewhere). Position p holds the
    distribution of token p + 1. The full forward runs only when the distribution is asked for, and
    the head walks the wanted positions in chunks, so [S, V] logits never exist at once.
    `last_hidden`: also the final-normed last hidden states [B, S, H], from which the frozen head
    gives the whole distribution (a fourth value, else None)."""
    base = getattr(model, "model", model)  # the decoder stack: no LM head over the sequence
    whole = top_k > 0 or last_hidden
    with capture(model, layer_ids, stop_after_last=not whole) as captured:
        try:
            out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            out = None
    missing = [i for i in layer_ids if i not in captured]
    if missing:
        raise RuntimeError(f"layers {missing} were not reached by the forward")
    # a target spread over several GPUs leaves its layers' outputs on theirs: gathered where the ids are
    features = torch.cat([captured[i].to(input_ids.device) for i in layer_ids], dim=-1)
    hidden = out.last_hidden_state.to(input_ids.device) if whole else None  # final-normed
    if top_k == 0:
        return features, None, None, hidden
    assert hidden is not None  # top_k > 0 ran the whole forward
    head = cast("PreTrainedModel", model).get_output_embeddings().weight
    B, S, _ = hidden.shape
    ids = torch.zeros(B, S, top_k, dtype=torch.long, device=hidden.device)
    probs = torch.zeros(B, S, top_k, dtype=torch.float32, device=hidden.device)
    wanted = want_BS.bool() if want_BS is not None else torch.ones(B, S, dtype=torch.bool, device=hidden.device)
    rows = wanted.nonzero()
    chunk = max(1, max_chunk_bytes // (4 * head.shape[0]))
    for start in range(0, rows.shape[0], chunk):
        b, s = rows[start : start + chunk].unbind(-1)
        logp = torch.log_softmax((hidden[b, s].to(head.dtype) @ head.t()).float(), dim=-1)
        top = logp.topk(top_k, dim=-1)
        ids[b, s], probs[b, s] = top.indices, top.values.exp()
    return features, ids, probs, hidden if last_hidden else None


def _weight_map(target_dir: Path) -> dict[str, str]:
    """Tensor name → the safetensors file holding it."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    with safe_open(target_dir / "model.safetensors", "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _is_embedding(name: str) -> bool:
    return name.endswith("embed_tokens.weight") and "mtp" not in name


def embedding_rows(target_dir: str | Path, rows: list[int]) -> torch.Tensor:
    """Rows of the target's input embedding [len(rows), H], read alone (a 27B target's table is
    2.5 GB; these are a few KB)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    weight_map = _weight_map(target_dir)
    name = next((k for k in sorted(weight_map) if _is_embedding(k)), None)
    if name is None:
        raise DFlashError(
            "no embed_tokens weight: not a language model's checkpoint (a drafter folder?); give the target model",
            file=str(target_dir),
        )
    with safe_open(target_dir / weight_map[name], "pt") as f:
        table = f.get_slice(name)
        return torch.cat([table[r : r + 1] for r in rows]).float()


def read_tensors(target_dir: str | Path, want) -> dict[str, torch.Tensor]:
    """The checkpoint tensors whose names `want(name)` accepts, read from the target's safetensors
    alone (sharded or not); nothing else of the target is loaded. On an `s3://` folder each is read
    by its own byte range (`tensor_ranges`): nothing else of the files crosses the network."""
    from safetensors import safe_open

    from dflash_ray import storage

    with progress.doing(f"reading the tensors it needs of {target_dir}"):  # a start-up's wait names it
        if storage.is_s3(str(target_dir)):
            from dflash_ray import tensor_ranges

            return tensor_ranges.read_tensors(str(target_dir), want)  # its ranges counted as they arrive
        target_dir = Path(target_dir)
        weight_map = _weight_map(target_dir)
        out = {}
        for file in sorted({weight_map[k] for k in weight_map if want(k)}):
            with safe_open(target_dir / file, "pt") as f:
                for k in filter(want, f.keys()):
                    out[k] = f.get_tensor(k)
                    progress.add(out[k].nbytes)  # and the bytes read from the node's disk
        return out


def load_embed_and_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head. A tied head returns the embedding twice."""
    tensors = read_tensors(target_dir, lambda k: _is_embedding(k) or k.endswith("lm_head.weight"))
    embed = next((v for k, v in sorted(tensors.items()) if k.endswith("embed_tokens.weight")), None)
    if embed is None:
        raise DFlashError(
            "no embed_tokens weight: not a language model's checkpoint (a drafter folder?); give the target model",
            file=str(target_dir),
        )
    head = next((v for k, v in tensors.items() if k.endswith("lm_head.weight")), embed)
    return embed, head
