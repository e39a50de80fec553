"""The peers' offline training data, written once from a demo run's tokenized samples: the bf16
target's hidden states a sample, from one forward each, as our target actors capture them (the
output of each decoder layer in `layer_ids`, before any norm), in each peer's own layout."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


def target_samples(tokenized: str, layer_ids: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids [S], loss_mask [S], the outputs of `layer_ids` [S, n, H]) of each sample in turn."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from dflash_ray import manifest, storage
    from dflash_ray.registry import SMOLLM2, resolve
    from dflash_ray.target_model.capture import target_features

    torch.set_num_threads(1)  # on a busy machine two threads wait on each other (20x slower here)
    model = AutoModelForCausalLM.from_pretrained(resolve(SMOLLM2), dtype=torch.bfloat16).eval()
    for f in manifest.dataset_files(tokenized):
        for row in pq.read_table(io.BytesIO(storage.read_bytes(f)), columns=["input_ids", "loss_mask"]).to_pylist():
            ids = torch.tensor(row["input_ids"], dtype=torch.long)
            features = target_features(model, ids[None], layer_ids)[0]
            yield ids, torch.tensor(row["loss_mask"], dtype=torch.long), features.view(len(ids), len(layer_ids), -1)


def written_once(out: Path, key: dict[str, Any], write: Callable[[], dict[str, int]]) -> dict[str, Any]:
    """`write()`'s files in `out` (it returns their figures: samples, longest), unless `out` already
    holds them for the same `key`; the summary, with the seconds the writing took."""
    done = out / "_done.json"
    if done.exists() and all(json.loads(done.read_text()).get(k) == v for k, v in key.items()):
        return json.loads(done.read_text())
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    summary = {**key, **write(), "seconds": round(time.time() - started, 1)}
    done.write_text(json.dumps(summary))
    return summary


def specforge_files(tokenized: str, out: Path, layer_ids: list[int]) -> dict[str, Any]:
    """SpecForge's offline DFlash files, one a sample (`data_NNNNNN.ckpt`): input_ids [S],
    loss_mask [S] and hidden_states [S, n*H], the layers concatenated in `layer_ids` order (what its
    capture writes)."""

    def write() -> dict[str, int]:
        lengths = []
        for i, (ids, mask, features) in enumerate(target_samples(tokenized, layer_ids)):
            sample = {"input_ids": ids, "loss_mask": mask, "hidden_states": features.flatten(1).contiguous()}
            torch.save(sample, out / f"data_{i:06d}.ckpt")
            lengths.append(len(ids))
        return {"samples": len(lengths), "longest": max(lengths)}

    return written_once(out, {"layer_ids": layer_ids}, write)


def speculators_files(tokenized: str, out: Path, layer_ids: list[int], last_layer: int) -> dict[str, Any]:
    """speculators' offline layout (`--hidden-states-backend file`): a `datasets` folder (input_ids,
    loss_mask, seq_len) and `hidden_states/hs_I.safetensors` a sample, holding hidden_states
    [S, n+1, H] (the layers of `layer_ids`, then the last decoder layer's output, from which its
    trainer computes the labels) and token_ids [S]."""
    from datasets import Dataset
    from safetensors.torch import save_file

    def write() -> dict[str, int]:
        (out / "hidden_states").mkdir(exist_ok=True)
        rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        for i, (ids, mask, features) in enumerate(target_samples(tokenized, [*layer_ids, last_layer])):
            save_file(
                {"hidden_states": features.contiguous(), "token_ids": ids},
                out / "hidden_states" / f"hs_{i}.safetensors",
            )
            rows["input_ids"].append(ids.tolist())
            rows["loss_mask"].append(mask.tolist())
            rows["seq_len"].append(len(ids))
        dataset = Dataset.from_dict(rows)
        dataset.set_format(type="torch")
        dataset.save_to_disk(str(out))
        return {"samples": len(rows["seq_len"]), "longest": max(rows["seq_len"])}

    return written_once(out, {"layer_ids": layer_ids, "last_layer": last_layer}, write)
