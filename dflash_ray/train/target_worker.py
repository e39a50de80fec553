"""The target's side of a training stream, as a plain class (Ray makes it an actor at launch).

`TargetWorker` reads its samples from the tokenized dataset and returns the frozen target's context
features for them: to the host, to a colocated drafter as they are, or posted to the stream's
drafters by `handoff`. Apart from the drafter's side (`workers.py`) because the two share no state:
a drafter only ever sees the features sent to it. None of it imports Ray.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dflash_ray.config import TrainConfig
from dflash_ray.train import handoff
from dflash_ray.train.clocks import Clock
from dflash_ray.train.devices import actor_placement, wait_compute
from dflash_ray.train.schedule import Sample


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


def anchor_seeds(samples: list[Sample], device: torch.device | str) -> dict[str, torch.Tensor]:
    """`anchor_seed` [B] int64: the seed of each row's anchors, from the schedule's samples
    (`schedule.Drawn`); nothing for samples without one (held-out ones: an evaluation draws its
    anchors from a fixed seed). On the batch's device, since send/recv moves device tensors alone."""
    seeds = [getattr(s, "anchor_seed", None) for s in samples]
    if not seeds or any(seed is None for seed in seeds):
        return {}
    return {"anchor_seed": torch.tensor(seeds, dtype=torch.long, device=device)}


class TargetWorker:
    def __init__(self, target: str, layer_ids: list[int], cfg: TrainConfig):
        from dflash_ray import hf_load
        from dflash_ray.registry import resolve

        torch.set_num_threads(cfg.torch_threads)
        self.layer_ids, self.cfg = layer_ids, cfg
        self.place = actor_placement(cfg, target=True)
        # a target too big for one GPU spreads its layers over the GPUs the actor holds
        spread = {"device_map": "auto"} if self.place.num_devices > 1 else {}
        self.model = hf_load.causal_lm(resolve(target), dtype=self.place.dtype, **spread).eval()
        if not spread:
            self.model.to(self.place.device)
        from dflash_ray.train.file_cache import FileCache

        # the files of the schedule's window, and of the next while a step straddles the two
        self.reader = FileCache(2 * cfg.shard_window)
        self._staging: dict[str, torch.Tensor] = {}
        from dflash_ray.train.feature_cache import FeatureCache

        self.cache = FeatureCache(int(cfg.feature_cache_gb * 1024**3))
        self.clock = Clock(cfg.clocks)  # the GPU's durations, when the run replays them (`train.clocks`)
        self._sent: list = []  # `handoff.Sent` of batches whose receivers may still be taking them
        from dflash_ray.train.drafters import target_sends

        self.top_k, self.last_hidden = target_sends(cfg)

    def kernels(self) -> list[str]:
        """The fast kernels a hybrid target goes without on its GPU (`fastpath.check`: refused
        unless `train.allow_slow_target`)."""
        from dflash_ray.target_model import fastpath

        return fastpath.check(self.model, self.place.device, self.cfg.allow_slow_target)

    def join_run(self, address: str, port: int, stream: int, layout) -> None:
        """Join the run's process group (`handoff`) as stream `stream`'s target, to send features to
        the stream's drafters."""
        handoff.join(
            self.place.backend,
            address,
            port,
            layout.target(stream),
            layout,
            self.cfg.collective_timeout_s,
            self.clock.watchdog_s(self.cfg.collective_timeout_s),
        )
        handoff.greet([layout.drafter(t, stream) for t in range(layout.teams)], True, self.place.device)

    def send_features(
        self, samples: list[Sample], dsts: list[int], profile: str | None = None, stall: bool = False
    ) -> dict[str, Any]:
        """The batch's features posted to the drafters at ranks `dsts` (`handoff.send`); returns what
        they allocate to receive them, the target's seconds and the bytes each receives. The sends of
        earlier batches that every receiver has are let go here (their buffers with them)."""
        self._sent = [s for s in self._sent if not s.done()]
        batch = self.features(samples, to_host=False, profile=profile, stall=stall)
        seconds, read = batch.pop("seconds"), batch.pop("read_bytes")
        self.clock.transfer(batch["input_ids"].numel())
        sent = handoff.send(batch, dsts)
        self._sent.append(sent)
        return {"meta": sent.meta, "seconds": seconds, "read_bytes": read, "bytes": handoff.nbytes(sent.meta)}

    def features(
        self, samples: list[Sample], to_host: bool = True, profile: str | None = None, stall: bool = False
    ) -> dict[str, Any]:
        """The batch and its features (and with `train.distill`, the target's top-k next-token
        distribution at the response positions); `to_host=False` leaves them on the device.
        `profile`: where to write a trace of it (`train.profile_steps`). `stall`: block forever, as a
        read from storage that never answers would (`train.stall_step`: the deadlines' drill)."""
        from dflash_ray.train.profile import traced

        if stall:
            import threading

            threading.Event().wait()
        with traced(profile):
            return self._features_of(samples, to_host)

    def _features_of(self, samples: list[Sample], to_host: bool) -> dict[str, Any]:
        from dflash_ray.target_model.capture import target_outputs

        start = time.perf_counter()
        device = self.place.device
        # computed before: the frozen target would give the same tensors again (kept on the host)
        kept = self.cache.get(samples, "cpu" if to_host else device)
        if kept is not None:
            kept.update(anchor_seeds(samples, "cpu" if to_host else device))
            return {**kept, "seconds": time.perf_counter() - start, "read_bytes": 0}
        rows = [self.reader.row(uri, row) for uri, row in samples]
        for (uri, row), sample in zip(samples, rows):  # one len() each: padding would hide the mismatch
            if len(sample["input_ids"]) != len(sample["loss_mask"]):
                from dflash_ray.errors import DFlashError

                raise DFlashError(
                    f"{len(sample['loss_mask'])} loss_mask entries for {len(sample['input_ids'])} input_ids: "
                    "a mask marks each token; `dflash-ray validate` lists every such sample",
                    file=uri,
                    record=row + 1,
                    field="loss_mask",
                )
        ids, mask, attn = pad_batch(rows)
        self.clock.forward(ids.numel())
        vocab = self.model.get_input_embeddings().num_embeddings
        if ids.numel() and int(ids.max()) >= vocab:  # one reduction a batch; the sample is looked for only then
            self._past_vocabulary(samples, rows, vocab)
        want = torch.zeros_like(mask)
        want[:, :-1] = mask[:, 1:]  # position p holds the distribution of token p + 1
        feats, teacher_ids, teacher_probs, hidden = target_outputs(
            self.model,
            ids.to(device),
            self.layer_ids,
            attention_mask=attn.to(device),
            top_k=self.top_k,
            want_BS=want.to(device),
            last_hidden=self.last_hidden,
        )
        batch = {"input_ids": ids, "loss_mask": mask, "features": feats}
        if self.top_k:
            batch.update(teacher_ids=teacher_ids.int(), teacher_probs=teacher_probs.half())
        if self.last_hidden:
            batch["target_hidden"] = hidden.to(feats.dtype)
        self.cache.keep(samples, batch)  # without the anchor seeds: a later epoch's are others
        for key, value in batch.items():
            batch[key] = self._staged(key, value) if to_host else value.to(device)
        batch.update(anchor_seeds(samples, "cpu" if to_host else device))
        # the compute stream alone: a device-wide synchronization would wait for this target's own
        # sends still unmatched (NCCL's stream), which its drafter takes only at its next step
        wait_compute(device)
        return {**batch, "seconds": time.perf_counter() - start, "read_bytes": self.reader.take_bytes()}

    @staticmethod
    def _past_vocabulary(samples: list[Sample], rows: list[dict[str, Any]], vocab: int) -> None:
        """Name the first sample with an id past the target's table: data of another tokenizer."""
        from dflash_ray.errors import DFlashError

        for (uri, row), sample in zip(samples, rows):
            if sample["input_ids"] and max(sample["input_ids"]) >= vocab:
                raise DFlashError(
                    f"token id {max(sample['input_ids'])} is past the target's {vocab}-entry "
                    "embedding: the data was tokenized for another model; tokenize it with the "
                    "target's tokenizer",
                    file=uri,
                    record=row + 1,
                    field="input_ids",
                )

    def _staged(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """A GPU tensor copied to the host through a page-locked buffer kept per key (several times
        the speed of a pageable copy); Ray serializes the returned view before this actor's next call,
        so the buffer is free again by then."""
        if not value.is_cuda:
            return value.cpu()
        staging = self._staging.get(key)
        if staging is None or staging.numel() < value.numel() or staging.dtype != value.dtype:
            staging = self._staging[key] = torch.empty(value.numel(), dtype=value.dtype, pin_memory=True)
        view = staging[: value.numel()].view(value.shape)
        view.copy_(value, non_blocking=True)
        return view
