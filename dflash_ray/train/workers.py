"""The drafter's side of a training stream, as plain classes (Ray makes them actors at launch).

`DrafterWorker` owns the drafter, the frozen embedding and LM head, the optimizer and schedule; it
computes the loss and gradients on the features it is given (by the stream's
`target_worker.TargetWorker`) and steps. A training batch's anchors come from seeds it carries, one
per sample (`schedule.anchor_seed`), never from a rank's generator. With several streams the drafters shard the weights,
gradients and optimizer state among themselves (`fsdp`, FSDP2 over torch.distributed: NCCL between
GPUs, gloo on the CPU). `ColocatedWorker` is both in one process, on one device: the features never
leave it. Each places itself with `devices.actor_placement` (the GPU Ray gave it, or the CPU). None
imports Ray.
"""

from __future__ import annotations

import datetime
import json
import math
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from dflash_ray.config import TrainConfig
from dflash_ray.train import handoff
from dflash_ray.train.clocks import Clock
from dflash_ray.train.fsdp import make_mesh_groups
from dflash_ray.train.devices import actor_placement
from dflash_ray.train.schedule import Sample
from dflash_ray.train.target_worker import TargetWorker

if TYPE_CHECKING:
    from dflash_ray.train.checkpoint import Upload


def lr_at(done: int, total: int, peak: float, warmup_ratio: float, unit: int = 1) -> float:
    """Linear warmup then cosine decay to zero, over `total` samples of which `done` are behind the
    step (`unit`: the step's own samples). By samples, not steps: a run whose step count changes (a
    resume on another `train.num_streams`) keeps its rate where it was."""
    warmup = max(1, int(round(total * warmup_ratio)))
    if done < warmup:
        return peak * min(1.0, (done + unit) / warmup)
    progress = (done - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class DrafterWorker:
    def __init__(
        self,
        target: str,
        drafter_cfg_json: str,
        init: str,
        cfg: TrainConfig,
        rank: int,
        world: int,
        pick: list[int] | None = None,
    ):
        """`pick`: the positions of this drafter's target layers among those the target captures
        (several drafters from one target pass); None: all of them, in order."""
        from dflash_ray.drafter import families
        from dflash_ray.drafter.export import from_hf_config
        from dflash_ray.drafter.init import initial_drafter
        from dflash_ray.registry import tensor_source
        from dflash_ray.target_model.capture import load_embed_and_head

        torch.set_num_threads(cfg.torch_threads)
        self.cfg, self.rank, self.world, self.pick = cfg, rank, world, pick
        self.place = actor_placement(cfg)
        self.dtype, device = self.place.dtype, self.place.device
        # only the tensors it needs (the embedding, the head, the layers it starts from): by their
        # byte ranges from an s3:// target, never the whole folder (`registry.tensor_source`)
        target_dir = tensor_source(target)
        # fp32 master weights on the device; the frozen embedding and head in the compute dtype beside them
        self.drafter = initial_drafter(from_hf_config(json.loads(drafter_cfg_json)), target_dir, init, cfg.seed).to(
            device
        )
        self.family = families.get(self.drafter.cfg.family)  # its loss (`forward_loss`) and positions
        embed, head = load_embed_and_head(target_dir)
        self.embed = embed.to(device, self.dtype)
        self.head = self.embed if head is embed else head.to(device, self.dtype)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        from dflash_ray.train.profile import flops_per_position, peak_flops

        self.flops_per_position = flops_per_position(self.drafter, self.head)
        self.peak_flops = peak_flops(device)  # None: a device without a known peak (no MFU)
        # the anchors of a batch that carries no seeds of its own (one built by hand): drawn on the
        # CPU on every device, so they do not depend on where the run runs
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
        self.total_steps = 1  # the rate's schedule in steps, for a worker driven by hand (`set_total_steps`)
        self.upload: Upload | None = None  # rank 0's checkpoint upload in flight (`checkpoint.Upload`)
        self.group = None  # this drafter's ranks (torch.distributed), when the run has several streams
        # the same ranks over gloo, for checkpoints alone (DCP plans its saves from a background
        # thread: never on the group training's collectives use); None: a lone process
        self.ckpt_group = None
        self.source: int | None = None  # the global rank of this stream's target, when features come by `handoff`
        self.clock = Clock(cfg.clocks)  # the GPU's durations, when the run replays them (`train.clocks`)

    def _autocast(self):
        """bf16 compute over fp32 master weights (the optimizer only ever sees fp32)."""
        return torch.autocast(
            self.place.device.split(":")[0], dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16
        )

    # -- collective -------------------------------------------------------------------------
    def init_group(self, address: str, port: int, rows: list[list[int]] | None = None) -> None:
        """Join the drafters' process group and shard the drafter over it; `address` is rank 0's own
        node (it hosts the store); `rows`: the ranks' mesh (`train/mesh.py`) where it has several rows."""
        import torch.distributed as dist

        if self.world > 1:  # a rank that never reaches a collective fails the others after the timeout
            timeout = datetime.timedelta(seconds=self.cfg.collective_timeout_s)
            dist.init_process_group(
                self.place.backend,
                init_method=f"tcp://{address}:{port}",
                rank=self.rank,
                world_size=self.world,
                timeout=timeout,
            )
            self.ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
            rows = rows if rows and len(rows) > 1 else []
            self._shard(dist.group.WORLD, rows, make_mesh_groups(rows, timeout))

    def join_run(self, address: str, port: int, team: int, layout) -> None:
        """Join the run's process group (`handoff`: features come from this stream's target by
        send/recv) and shard the drafter over this team's subgroup of it."""
        groups, ckpt_groups, mesh_groups = handoff.join(
            self.place.backend,
            address,
            port,
            layout.drafter(team, self.rank),
            layout,
            self.cfg.collective_timeout_s,
            self.clock.watchdog_s(self.cfg.collective_timeout_s),
        )
        self.ckpt_group = ckpt_groups[team]
        self.source = source = layout.target(self.rank)
        handoff.greet([source], False, self.place.device)
        if self.world > 1:
            self._shard(groups[team], layout.team_rows(team), mesh_groups[team])

    def _shard(self, group, rows: list[list[int]], mesh_groups: tuple) -> None:
        """Shard (or replicate) the drafter over `group`'s ranks: one row of them, or the 2-D mesh of
        `rows` (global ranks) from this rank's row and column groups."""
        from dflash_ray.train.fsdp import apply_fsdp, mesh_of

        self.group = group
        device_type = self.place.device.split(":")[0]
        mesh = mesh_of(rows, mesh_groups, device_type) if rows else group
        reduce = self.dtype if self.cfg.reduce_dtype == "auto" else getattr(torch, self.cfg.reduce_dtype)
        apply_fsdp(
            self.drafter, device_type, mesh, self.dtype, reduce_dtype=reduce, keep_gathered=self.cfg.keep_gathered
        )
        # the optimizer over the shards this rank now holds (its state was still empty)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def set_total_steps(self, total: int) -> None:
        """A worker driven by hand (a benchmark, a test): its rate scheduled over `total` steps, where
        a run gives each step its point in samples (`train_step`'s `point`)."""
        self.total_steps = total

    # -- training ---------------------------------------------------------------------------
    def _features(self, batch: dict[str, Any]) -> torch.Tensor:
        """This drafter's target layers [B, S, L·H], on its device in its compute dtype: all the
        captured ones, or its own among those of several drafters (`pick`)."""
        features = batch["features"].to(self.place.device, self.dtype)
        if self.pick is None:
            return features
        return features.unflatten(-1, (-1, self.drafter.cfg.hidden_size))[:, :, self.pick].flatten(2)

    def averaged_gradients(self, batch: dict[str, Any]):
        """The gradients of the loss over the union of every stream's batch (`gradients.averaged`)."""
        from dflash_ray.train import gradients

        return gradients.averaged(self, batch)

    @torch.no_grad()
    def evaluate(self, batch: dict[str, Any]) -> list[float]:
        """Simulated acceptance lengths on a held-out batch, with anchors from a fixed seed so
        evaluations at different steps score the same blocks. The batch comes as training's do (by
        `handoff` when the run sends its features) and runs the training attention at its padded
        lengths, so an evaluation never needs more memory than a step, nor a new compiled shape."""
        batch = handoff.taken(batch, self.source, self.place.device)
        return self._forward(batch, torch.Generator().manual_seed(self.cfg.seed), False).tau.tolist()

    def _forward(self, batch: dict[str, Any], generator: torch.Generator, grad: bool, **extra: Any):
        """The family's forward and loss on a batch: each row's anchors from its seed where the batch
        carries them (`anchor_seed`: the same whichever rank or pass takes the batch), else from
        `generator`. Compiled attention (GPU) builds one graph per (batch, padded length, grad mode)
        on its first use in this process: `warm_up` meets them all before step 0; under
        `train.clocks` the first use costs the GPU's compile time."""
        from dflash_ray.drafter.forward import bucket_length

        device = self.place.device
        ids = batch["input_ids"]
        padded = bucket_length(ids.shape[1], self.cfg.length_bucket)
        self.clock.compile((ids.shape[0], padded, grad))
        self.clock.step(ids.shape[0] * padded * (1 if grad else 1 / 3))  # no backward: a third of a step
        with self._autocast():
            return self.family.forward_loss(
                self.drafter,
                self.embed,
                self.head,
                self._features(batch),
                ids.to(device),
                batch["loss_mask"].to(device),
                num_anchors=self.cfg.num_anchors,
                generator=generator,
                attention=self.place.attention,
                length_bucket=self.cfg.length_bucket,
                anchor_seeds=batch.get("anchor_seed"),
                **extra,
            )

    def warm_up(self, shapes: list[tuple[int, int, bool]], cache: str | None = None) -> dict[str, Any]:
        """Meet every graph shape the run will before step 0 (`warmup.warm_up`)."""
        from dflash_ray.train.warmup import warm_up

        return warm_up(self, shapes, cache)

    def train_step(
        self,
        step: int,
        *batches: dict[str, Any],
        point: tuple[int, int, int] | None = None,
        passes: int = 1,
        fault: bool = False,
        profile: str | None = None,
    ) -> dict[str, float]:
        """Averaged gradients over this rank's batches of the step (one, or several when it stands in
        for lost streams: `passes` forward and backward passes on every rank), clipping, the learning
        rate at the step's `point` (samples behind it, its own, the run's: `schedule.Schedule.point`;
        None: the step of `set_total_steps`'s), one AdamW step. `fault`: raise before the step's
        collectives, as an out-of-memory error would (chaos testing). `profile`: where to write a
        trace of the step (`train.profile_steps`)."""
        from dflash_ray.train.profile import traced

        with traced(profile):
            return self._train_step(step, iter(batches), passes, point or (step, 1, self.total_steps), fault)

    def _train_step(
        self, step: int, batches: Iterator[dict[str, Any]], passes: int, point: tuple[int, int, int], fault: bool
    ) -> dict[str, Any]:
        from dflash_ray.train import gradients
        from dflash_ray.train.fsdp import full

        if fault:
            raise RuntimeError(f"injected fault at step {step + 1} on drafter rank {self.rank} (train.fault_step)")
        start = time.perf_counter()
        taken = (handoff.taken(b, self.source, self.place.device) for b in batches)  # received in turn
        if passes == 1:
            batch = next(taken)
            out, loss, _ = gradients.averaged(self, batch)  # reads figures back: the device is idle after
            figures = [gradients.figures(self, out, batch)]
        else:
            figures, loss, _ = gradients.accumulated(self, taken, passes)
        stepping = time.perf_counter()
        grad_norm = float(full(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.clip)))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank sees the same two numbers
            from dflash_ray.errors import DFlashError

            raise DFlashError(
                f"step {step + 1}: the loss is {loss} and the gradient norm {grad_norm}, not finite: the "
                "run stops with this step not applied (a restart would diverge the same way); the "
                "newest checkpoint holds the last finite weights. Lower train.lr, or look at the "
                "step's samples",
                field="train.lr",
            )
        done_samples, unit, total = point
        lr = lr_at(done_samples, total, self.cfg.lr, self.cfg.warmup_ratio, unit)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        done = time.perf_counter()
        n = len(figures)
        return {
            "loss": loss,
            "tau": sum(f["tau"] for f in figures) / n,
            "acc_k1": sum(f["acc_k1"] for f in figures) / n,  # the first drafted token
            "grad_norm": grad_norm,
            "lr": lr,
            "drafter_seconds": done - start,
            "optimizer_seconds": done - stepping,
            **{k: sum(f[k] for f in figures) for k in ("target_seconds", "handoff_seconds", "read_bytes", "tokens")},
            "flops": sum(f["flops"] for f in figures),
            "peak_flops": self.peak_flops,
        }

    # -- state ------------------------------------------------------------------------------
    def rng_state(self) -> bytes:
        return self.generator.get_state().numpy().tobytes()

    def set_rng_state(self, state: bytes) -> None:
        import numpy as np

        self.generator.set_state(torch.from_numpy(np.frombuffer(state, dtype=np.uint8).copy()))

    def write_checkpoint_files(self, output: str, step: int) -> None:
        """This rank's shard of the weights and optimizer state (`checkpoint_files.save`): copied to host memory
        now, written to the checkpoint in the background, so the step waits for no storage and no
        other rank's data; rank 0 adds the serving config. Every rank calls it (DCP plans the save
        with the others, over a gloo group of their own)."""
        from dflash_ray.drafter.export import CONFIG, to_hf_config
        from dflash_ray.train import checkpoint, checkpoint_files

        self.upload_entries(wait=True)  # one upload at a time (the coordinator commits each first)
        extra = (
            {f"drafter/{CONFIG}": json.dumps(to_hf_config(self.drafter.cfg, torch.float32), indent=2).encode()}
            if self.rank == 0
            else {}
        )
        self.upload = checkpoint_files.save(
            self.drafter, self.opt, checkpoint.step_dir(output, step), self.ckpt_group, extra
        )

    def upload_entries(self, wait: bool) -> dict[str, dict] | None:
        """The manifest entries of this rank's newest checkpoint files once they are all written; None
        while they are being written (`wait=False`); {} when there is none. Kept until the next
        checkpoint: the coordinator may ask again, when another rank was not done the first time."""
        upload = self.upload
        if upload is None:
            return {}
        if not (wait or upload.done()):
            return None
        return upload.result()

    def load_checkpoint(self, output: str, step: int) -> None:
        """This rank's shards of the weights and optimizer state, whatever the number of ranks that
        wrote them (`checkpoint_files.load` reads only the files its pieces lie in, each checked against the
        manifest), and this rank's generator (`rng`, where the checkpoint has it; training's anchors
        come from their samples' seeds, not from it): `checkpoint.CorruptCheckpoint` when a file differs."""
        from dflash_ray.train import checkpoint, checkpoint_files

        manifest = checkpoint.read_manifest(output, step)
        rngs = json.loads(checkpoint.read_file(output, step, "state.json", manifest)).get("rng", [])
        checkpoint_files.load(self.drafter, self.opt, checkpoint.step_dir(output, step), manifest, self.ckpt_group)
        if self.rank < len(rngs):  # a rank a resharded resume adds keeps its seeded generator
            self.set_rng_state(bytes.fromhex(rngs[self.rank]))


class ColocatedWorker(DrafterWorker):
    """A whole stream in one process: the target and the drafter on one device (one GPU, or the
    CPU). The features go straight from the target's hooks into the drafter's step, with no copy."""

    def __init__(
        self,
        target: str,
        layer_ids: list[int],
        drafter_cfg_json: str,
        init: str,
        cfg: TrainConfig,
        rank: int,
        world: int,
        pick: list[int] | None = None,
    ):
        """`layer_ids`: what the target captures; `pick`: the drafter's among them, as a paired
        drafter's (a small target's default layers repeat one: [1, 1, 1, 1] of four)."""
        from dflash_ray.registry import resolve

        target = resolve(target)  # the node's copy: the drafter's tensors and the target's from one folder
        super().__init__(target, drafter_cfg_json, init, cfg, rank, world, pick)
        self.target = TargetWorker(target, layer_ids, cfg)

    def train_samples(
        self,
        step: int,
        micro: list[list[Sample]],
        point: tuple[int, int, int] | None = None,
        passes: int = 1,
        fault: bool = False,
        profile: str | None = None,
    ) -> dict[str, float]:
        """`DrafterWorker.train_step` on the features of `micro` (this stream's batches of the step),
        each computed here as its turn comes."""
        from dflash_ray.train.profile import traced

        batches = (self.target.features(samples, to_host=False) for samples in micro)
        with traced(profile):  # the target's forward and the drafter's step in one trace
            return self._train_step(step, batches, passes, point or (step, 1, self.total_steps), fault)

    def kernels(self) -> list[str]:
        return self.target.kernels()

    def evaluate_samples(self, samples: list[Sample]) -> list[float]:
        return self.evaluate(self.target.features(samples, to_host=False))
