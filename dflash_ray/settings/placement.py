"""`train`'s placement: the streams and their actors' resources (`train/elastic.py`,
`train/streams.py`), how the drafters' ranks hold the weights and reduce gradients
(`train/mesh.py`, `layout_choice.py`), how features travel (`train/p2p.py`), the compute dtype and
attention kernel (`devices.py`, `drafter/attention.py`) and the target's host memory
(`train/feature_cache.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_ray.errors import DFlashError
from dflash_ray.settings.fields import above, at_least, operational


@dataclass(frozen=True, kw_only=True)
class Placement:
    num_streams: int = operational(at_least(1, default=2))  # data-parallel target+drafter pairs
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU actors, fp32 on CPU ones
    attention: Literal["auto", "sdpa", "flex"] = "auto"  # auto: compiled flex on GPU, the dense SDPA mask on CPU
    # the drafter pads each batch's context to a multiple of this (the target runs unpadded), so compiled
    # attention meets at most max_seq_len / length_bucket shapes: one graph each
    length_bucket: int = at_least(1, default=512)
    # target and drafter of a stream in one actor on one device: no feature transfer
    colocate: bool = operational(False)
    # how the drafters' ranks hold the weights (train/mesh.py): fsdp (sharded over every rank), hsdp
    # (sharded over a node's ranks, replicated across nodes), replicate (whole on every rank); auto:
    # the plan's choice (`dflash-ray plan` prints it and why: layout_choice.py), hsdp where no plan ran
    layout: Literal["auto", "fsdp", "hsdp", "replicate"] = operational("auto")
    # the dtype gradients are reduced in across ranks; auto: the compute dtype (bf16 on GPU actors)
    reduce_dtype: Literal["auto", "float32", "bfloat16"] = operational("auto")
    # a layer's weights stay gathered from its forward to its backward (one all-gather a step, not two)
    keep_gathered: bool = operational(True)
    # how a paired stream's features reach its drafters: torch.distributed send/recv (NCCL on GPUs, gloo on
    # the CPU), or Ray's object store (serialized and copied: the slower path, kept to compare with)
    feature_transport: Literal["direct", "object_store"] = operational("direct")
    actor_cpus: float = operational(above(0, default=1.0))  # per actor; each target+drafter pair is packed on one node
    # per actor; > 0 places the target (bf16) and the drafter on the GPU Ray gives it
    actor_gpus: float = operational(at_least(0, default=0.0))
    # per target actor; None: actor_gpus. Over 1 spreads a target too big for one GPU over that many (its
    # captured layers are gathered onto the first); the drafter keeps actor_gpus
    target_gpus: float | None = at_least(0, default=None)
    # the stream actors' resources not granted by then: an error naming them
    placement_timeout_s: float = operational(above(0, default=600.0))
    # elastic streams: streams still not placed after placement_timeout_s (a node lost and not yet
    # replaced) leave the run to those placed, down to this many (as lost_streams says), and stay
    # asked for: once placed, the run grows back at its next checkpoint. None: num_streams (every
    # stream or none)
    min_streams: int | None = operational(at_least(1, default=None))
    # while streams are lost: shrink (each training stream takes its own batch a step, the global batch
    # shrinks with the streams, the step keeps its time and the learning rate follows the samples
    # taken) or stand_in (the placed streams take the lost ones' batches too: more passes a step, the
    # global batch and every sample's step and rate those of a run that lost nothing)
    lost_streams: Literal["shrink", "stand_in"] = operational("shrink")
    node_resource: str = operational("")  # a custom resource of the training nodes that every stream actor asks for
    torch_threads: int = operational(at_least(1, default=1))
    max_in_flight: int = operational(
        at_least(0, default=1)
    )  # target batches computed ahead of their drafter, per stream
    # host memory (GiB) per target actor for the outputs of batches it computed, served again to later
    # epochs (with batch_size 1) and to every held-out evaluation instead of a forward (train/feature_cache.py)
    feature_cache_gb: float = operational(at_least(0, default=0.0))
    # a hybrid target on CUDA whose Gated-DeltaNet kernels (flash-linear-attention, causal-conv1d) do not
    # import is refused at the start; true: train on transformers' torch fallback anyway (said in the summary)
    allow_slow_target: bool = operational(False)
    # GB/s of all-reduce bus bandwidth every node pair of the drafters must carry, measured before
    # training starts (`dflash-ray netcheck`); 0: not measured
    min_bus_bandwidth: float = operational(at_least(0, default=0.0))

    def check_placement(self) -> None:
        """A target over several GPUs, and the streams a run may shrink to."""
        if self.target_gpus is not None and self.target_gpus > 1:
            if self.target_gpus != int(self.target_gpus) or self.actor_gpus <= 0:
                raise DFlashError(
                    f"{self.target_gpus} GPUs spread a target over whole GPUs beside GPU drafters; "
                    "allowed: a whole number with train.actor_gpus > 0",
                    field="train.target_gpus",
                )
            if self.colocate:
                raise DFlashError(
                    "a target spread over several GPUs cannot share its actor with the drafter; "
                    "allowed: train.colocate=false",
                    field="train.target_gpus",
                )
        if self.min_streams is not None and self.min_streams > self.num_streams:
            raise DFlashError(
                f"{self.min_streams} is above train.num_streams={self.num_streams}; allowed: <= num_streams",
                field="train.min_streams",
            )
