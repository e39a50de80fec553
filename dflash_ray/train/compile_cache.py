"""Compiled artifacts kept with a run, so that a restart or a resumed run does not compile again.

torch collects what each compile produced (inductor's FX graphs, with their Triton kernels bundled
on CUDA, and AOTAutograd's entries) and serializes it whole (`torch.compiler.save_cache_artifacts`);
loaded into a fresh process (`torch.compiler.load_cache_artifacts`) before its first compile, the
bytes fill the local caches, and compiling the same graph again is a cache hit: dynamo still
traces the function, inductor builds nothing. A drafter actor calls `load(uri_for(output))` before
it warms its shapes and `save(uri_for(output))` after; `counts()` before and after tells what was
compiled in between.

Works on any URI `dflash_ray.storage` reads and writes (local paths, `file://`, `s3://`); the
file is written atomically. The artifacts are keyed by torch version, device and graph: bytes from
another torch, another device or other shapes are loaded and then simply miss.
On the CPU a hit skips lowering and code generation, but the C++ kernels are built again by the
compiler (their shared objects live only in the local `TORCHINDUCTOR_CACHE_DIR`, not in the
artifacts), so a CPU restart saves less time than a CUDA one, whose Triton kernels travel in the
artifacts (inductor's `bundle_triton_into_fx_graph_cache`, on by default; not yet timed on a GPU).
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

import torch

from dflash_ray import storage

if TYPE_CHECKING:
    from torch.compiler._cache import CacheInfo

COMPILE_CACHE = "compile-cache.bin"

# sha256 of the bytes this process last loaded from or saved to each URI: a save of the same bytes is skipped
_KNOWN: dict[str, str] = {}


def uri_for(output: str, tag: str = "") -> str:
    """The artifact file under a run's output folder. Drafters that compile different graphs
    (another shape or family) each keep their own, `tag` naming it; the ranks of one lock-step
    team compile the same graphs, so one file serves the team and rank 0 alone need save it."""
    name = f"compile-cache-{tag}.bin" if tag else COMPILE_CACHE
    return storage.join(output, name)


def load(uri: str) -> dict[str, Any]:
    """Load the artifacts saved at `uri`, if any, into this process's compile caches. Call it
    before the first compile. Returns `loaded_bytes` (0: no file), `entries` (artifacts by kind:
    `inductor`, `aot_autograd`, ...; empty when the bytes are not torch's artifacts) and `seconds`.
    The loaded artifacts are kept for this process's `save`, so a run that uses only some of them
    does not drop the others from the file."""
    started = time.perf_counter()
    try:
        data = storage.read_bytes(uri)
    except FileNotFoundError:
        return {"loaded_bytes": 0, "entries": {}, "seconds": round(time.perf_counter() - started, 3)}
    entries = _load(data)
    if entries:
        _KNOWN[uri] = hashlib.sha256(data).hexdigest()
    return {"loaded_bytes": len(data), "entries": entries, "seconds": round(time.perf_counter() - started, 3)}


def _load(data: bytes) -> dict[str, int]:
    info: CacheInfo | None
    try:
        from torch.compiler._cache import CacheArtifactManager as manager

        artifacts = manager.deserialize(data)  # None (and a warning) when the bytes are not artifacts
        if artifacts is None:
            return {}
        info = manager.populate_caches(artifacts)
        for kind, items in artifacts.items():  # carried into the next save (as a cache hit would be)
            for artifact in items:
                if artifact not in manager._seen_artifacts:
                    manager._new_cache_artifacts[kind].append(artifact)
                    manager._seen_artifacts.add(artifact)
    except (ImportError, AttributeError):  # another torch's internals: the public call, nothing carried
        info = torch.compiler.load_cache_artifacts(data)
    return {kind: len(keys) for kind, keys in info.artifacts.items()} if info is not None else {}


def save(uri: str) -> dict[str, Any]:
    """Write every artifact this process compiled, hit or loaded, to `uri` (atomically). Call it
    after the last compile worth keeping. Returns `saved_bytes` (0: nothing compiled), `written`
    (False when nothing was compiled or the file already holds these bytes), `entries` and `seconds`."""
    started = time.perf_counter()
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return {"saved_bytes": 0, "written": False, "entries": {}, "seconds": round(time.perf_counter() - started, 3)}
    data, info = result
    digest = hashlib.sha256(data).hexdigest()
    written = _KNOWN.get(uri) != digest
    if written:
        storage.write_bytes(uri, data)
        _KNOWN[uri] = digest
    return {
        "saved_bytes": len(data),
        "written": written,
        "entries": {kind: len(keys) for kind, keys in info.artifacts.items()},
        "seconds": round(time.perf_counter() - started, 3),
    }


def counts() -> dict[str, Any]:
    """What torch.compile did in this process so far: `graphs` dynamo traced (a cache hit is
    traced too), inductor's FX graph cache `hits`, `misses` and `bypasses` (a miss or a bypass is a
    graph compiled from scratch: `compiled`), AOTAutograd's cache hits and misses, and
    `compile_seconds` (dynamo's time in its frame compiles, tracing and cache loads included).
    With inductor's FX graph cache off (TORCHINDUCTOR_FX_GRAPH_CACHE=0) nothing is counted as
    compiled: `fx_graph_cache` says so."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import compilation_time_metrics, counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    misses, bypasses = inductor["fxgraph_cache_miss"], inductor["fxgraph_cache_bypass"]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "compiled": misses + bypasses,
        "hits": inductor["fxgraph_cache_hit"],
        "misses": misses,
        "bypasses": bypasses,
        "autograd_hits": aot["autograd_cache_hit"],
        "autograd_misses": aot["autograd_cache_miss"],
        "compile_seconds": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 3),
        "fx_graph_cache": bool(inductor_config.fx_graph_cache),
    }


def since(before: dict[str, Any]) -> dict[str, Any]:
    """`counts()` now, less `before` (an earlier `counts()`)."""
    now = counts()
    return {
        key: (
            round(value - before[key], 3) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
        )
        for key, value in now.items()
    }
