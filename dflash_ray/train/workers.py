"""The two roles of a training stream, as plain classes (Ray makes them actors at launch).

`TargetWorker` reads its samples from the tokenized dataset and returns the frozen target's
context features for them. `DrafterWorker` owns the drafter, the frozen embedding and LM head, the
optimizer and schedule and the anchor RNG; it computes the loss and gradients on the features it is
given, averages gradients with the other streams' drafters (torch.distributed, gloo on CPU), and
steps. Neither imports Ray.
"""

from __future__ import annotations

import io
import json
import math
import time
from typing import Any

import torch

from dflash_ray import storage
from dflash_ray.config import TrainConfig

Sample = tuple[str, int]  # (tokenized file URI, row in it)


def pad_batch(rows: list[dict[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input_ids, loss_mask and attention mask [B, S]."""
    S = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.long)
    attn = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = torch.tensor(r["loss_mask"])
        attn[i, :n] = 1
    return ids, mask, attn


class TargetWorker:
    def __init__(self, target: str, layer_ids: list[int], cfg: TrainConfig):
        from transformers import AutoModelForCausalLM

        from dflash_ray.registry import resolve

        torch.set_num_threads(cfg.torch_threads)
        self.layer_ids = layer_ids
        self.model = AutoModelForCausalLM.from_pretrained(resolve(target), dtype=getattr(torch, cfg.dtype)).eval()
        self._file, self._table = None, None

    def _row(self, uri: str, row: int) -> dict[str, list[int]]:
        if uri != self._file:
            import pyarrow.parquet as pq

            fs, path = storage.arrow_filesystem(uri)
            self._table = pq.read_table(path, filesystem=fs, columns=["input_ids", "loss_mask"])
            self._file = uri
        return {k: self._table[k][row].as_py() for k in ("input_ids", "loss_mask")}

    def features(self, samples: list[Sample]) -> dict[str, Any]:
        from dflash_ray.target.capture import target_features

        start = time.perf_counter()
        ids, mask, attn = pad_batch([self._row(uri, row) for uri, row in samples])
        feats = target_features(self.model, ids, self.layer_ids, attention_mask=attn)
        return {"input_ids": ids, "loss_mask": mask, "features": feats, "seconds": time.perf_counter() - start}


def lr_at(step: int, total: int, peak: float, warmup_ratio: float) -> float:
    """Linear warmup then cosine decay to zero."""
    warmup = max(1, int(round(total * warmup_ratio)))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class DrafterWorker:
    def __init__(self, target: str, drafter_cfg_json: str, init: str, cfg: TrainConfig, rank: int, world: int):
        from dflash_ray.drafter.export import from_hf_config
        from dflash_ray.drafter.init import initial_drafter
        from dflash_ray.registry import resolve
        from dflash_ray.target.capture import load_embed_and_head

        torch.set_num_threads(cfg.torch_threads)
        self.cfg, self.rank, self.world = cfg, rank, world
        target_dir = resolve(target)
        self.drafter = initial_drafter(from_hf_config(json.loads(drafter_cfg_json)), target_dir, init, cfg.seed)
        self.dtype = getattr(torch, cfg.dtype)
        embed, head = load_embed_and_head(target_dir)
        self.embed, self.head = embed.to(self.dtype), head.to(self.dtype)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
        self.total_steps = 1
        self.group_ready = False

    def _autocast(self):
        """bf16 compute over fp32 master weights (the optimizer only ever sees fp32)."""
        device = "cuda" if next(self.drafter.parameters()).is_cuda else "cpu"
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    # -- collective -------------------------------------------------------------------------
    def init_group(self, address: str, port: int) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=self.rank,
                                    world_size=self.world)
        self.group_ready = True

    def set_total_steps(self, total: int) -> None:
        self.total_steps = total

    # -- training ---------------------------------------------------------------------------
    def averaged_gradients(self, batch: dict[str, Any]):
        """Set every parameter's gradient to that of the loss over the union of all streams'
        batches: each stream backpropagates its weighted loss sum, the sums and weights are
        all-reduced together, and the total divides. Returns the step's forward output and the
        reduced (loss sum, weight sum)."""
        import torch.distributed as dist

        from dflash_ray.drafter.step import forward_loss

        with self._autocast():
            out = forward_loss(self.drafter, self.embed, self.head, batch["features"].to(self.dtype),
                               batch["input_ids"], batch["loss_mask"], num_anchors=self.cfg.num_anchors,
                               generator=self.generator, attention=self.cfg.attention, gamma=self.cfg.loss_decay)
        params = list(self.drafter.parameters())
        self.opt.zero_grad(set_to_none=False)
        weight = out.loss.weight_sum.detach().float()
        (out.loss.loss * weight).backward()
        flat = torch.cat([p.grad.flatten() for p in params] + [(out.loss.loss.detach() * weight).view(1), weight.view(1)])
        if self.world > 1:
            dist.all_reduce(flat)
        total_weight = flat[-1].clamp_min(1e-12)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p) / total_weight)
            offset += p.numel()
        return out, float(flat[-2] / total_weight), float(total_weight)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, Any]) -> list[float]:
        """Simulated acceptance lengths on a held-out batch, with anchors from a fixed seed so
        evaluations at different steps score the same blocks."""
        from dflash_ray.drafter.step import forward_loss

        with self._autocast():
            out = forward_loss(self.drafter, self.embed, self.head, batch["features"].to(self.dtype),
                               batch["input_ids"], batch["loss_mask"], num_anchors=self.cfg.num_anchors,
                               generator=torch.Generator().manual_seed(self.cfg.seed), attention="sdpa")
        return out.tau.tolist()

    def flat_grad(self) -> torch.Tensor:
        return torch.cat([p.grad.flatten() for p in self.drafter.parameters()])

    def train_step(self, step: int, batch: dict[str, Any]) -> dict[str, float]:
        """Averaged gradients, clipping, the scheduled learning rate, one AdamW step."""
        from dflash_ray.drafter.loss import per_position_accuracy

        start = time.perf_counter()
        out, loss, positions = self.averaged_gradients(batch)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.clip)
        lr = lr_at(step, self.total_steps, self.cfg.lr, self.cfg.warmup_ratio)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        acc = per_position_accuracy(out.loss.correct, out.blocks.weights, self.drafter.cfg.block_size)
        return {"loss": loss, "tau": float(out.tau.mean()) if out.tau.numel() else 1.0,
                "acc_k1": float(acc[1]), "grad_norm": float(grad_norm), "lr": lr,
                "drafter_seconds": time.perf_counter() - start, "target_seconds": batch["seconds"],
                "tokens": int(batch["loss_mask"].numel()), "positions": positions}

    # -- state ------------------------------------------------------------------------------
    def rng_state(self) -> bytes:
        return self.generator.get_state().numpy().tobytes()

    def set_rng_state(self, state: bytes) -> None:
        import numpy as np

        self.generator.set_state(torch.from_numpy(np.frombuffer(state, dtype=np.uint8).copy()))

    def write_checkpoint_files(self, output: str, step: int) -> dict[str, dict]:
        """Drafter (serving format, fp32) and optimizer state, written by this worker directly."""
        import tempfile
        from pathlib import Path

        from dflash_ray.drafter.export import CONFIG, WEIGHTS, save_drafter
        from dflash_ray.train import checkpoint

        entries = {}
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter(self.drafter, tmp, dtype=torch.float32)
            for name in (WEIGHTS, CONFIG):
                entries[f"drafter/{name}"] = checkpoint.write_file(output, step, f"drafter/{name}",
                                                                   (Path(tmp) / name).read_bytes())
        buf = io.BytesIO()
        torch.save(self.opt.state_dict(), buf)
        entries["optimizer.pt"] = checkpoint.write_file(output, step, "optimizer.pt", buf.getvalue())
        return entries

    def load_checkpoint(self, output: str, step: int) -> None:
        from safetensors.torch import load

        from dflash_ray.train import checkpoint

        files, _ = checkpoint.load(output, step)
        self.drafter.load_state_dict(load(files["drafter/model.safetensors"]))
        self.opt.load_state_dict(torch.load(io.BytesIO(files["optimizer.pt"]), weights_only=True))
        rng = json.loads(files["state.json"])["rng"][self.rank]
        self.set_rng_state(bytes.fromhex(rng))
