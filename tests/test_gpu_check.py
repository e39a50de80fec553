"""`make gpu-check`'s script at toy sizes on the CPU, so it cannot rot between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_every_check_on_cpu_tiny(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--json", "--compile-cache", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    checks = {x["check"]: x for x in lines}
    assert list(checks) == [
        "setup",
        "fused_ce",
        "flex_attention",
        "train_step",
        "hybrid_target",
        "speculative",
        "layout_step",
        "ray_free",
        "compile_cache",
    ], done.stderr[-3000:]
    assert all(x["ok"] for x in lines), lines
    assert done.returncode == 0
    assert checks["train_step"]["tokens_per_s"] > 0 and checks["train_step"]["attention"] == "sdpa"
    assert checks["speculative"]["equal_outputs"] == checks["speculative"]["prompts"]
    layout = checks["layout_step"]  # the bytes a rank of the preset's layout sends, as the plan counts them
    assert set(layout["traffic_ratio"]) == {"shard", "replicate"} and layout["step_s"] > 0, layout
    hybrid = checks["hybrid_target"]
    assert hybrid["layers"].count("linear_attention") == 3 and hybrid["tokens_per_s"] > 0
    assert hybrid["gated_deltanet"] == "torch fallback" and hybrid["batch_row_rel_err"] < 1e-4  # no fla on the CPU
    assert checks["fused_ce"]["loss_rel_err"] < 1e-5
    flex, train = checks["flex_attention"], checks["train_step"]
    assert flex["lengths"] == 10 and flex["compiled_graphs"] == flex["shapes"] == 2 and flex["graph_breaks"] == 0
    assert train["lengths"] == 10 and train["attention_shapes"] == train["buckets"] == 2
    # the first start with this cache: nothing to load; every graph the check compiled (or found in the
    # machine's local inductor cache) saved to the folder's file
    cache = checks["compile_cache"]
    assert cache["uri"] == str(tmp_path / "compile-cache.bin") and cache["loaded_bytes"] == 0
    assert cache["hits"] + cache["misses"] == flex["compiled_graphs"] == cache["graphs"] == 2
    assert cache["written"] and cache["saved_bytes"] == (tmp_path / "compile-cache.bin").stat().st_size > 0


# one start of a process that compiles `a @ b` at the given sizes between `load` and `save`
START = """
import json, sys, time, torch
from dflash_ray.train import compile_cache
uri, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]
before = compile_cache.counts()
loaded = compile_cache.load(uri)
matmul = torch.compile(lambda a, b: a @ b, dynamic=False)
started = time.perf_counter()
for n in sizes:
    matmul(torch.ones(n, 8), torch.ones(8, n))
first_calls = time.perf_counter() - started
saved = compile_cache.save(uri)
print(json.dumps({"load": loaded, "save": saved, "first_calls": first_calls, **compile_cache.since(before)}))
"""


def _start(uri: str, inductor_dir: Path, *sizes: int) -> dict:
    """A fresh process with its own empty TORCHINDUCTOR_CACHE_DIR: only the saved file can make a hit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    done = subprocess.run(
        [sys.executable, "-c", START, uri, *map(str, sizes)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_clock_a_second_start_loads_the_compile_cache_and_compiles_nothing(tmp_path):
    from dflash_ray.train import compile_cache

    uri = compile_cache.uri_for(str(tmp_path / "run"))
    first = _start(uri, tmp_path / "inductor-1", 4)
    assert first["load"]["loaded_bytes"] == 0 and first["misses"] == first["compiled"] == 1 and first["hits"] == 0
    assert first["save"]["written"] and first["save"]["saved_bytes"] == Path(uri).stat().st_size > 0

    second = _start(uri, tmp_path / "inductor-2", 4)  # a restart: same graph, nothing on the local disk
    assert second["load"]["loaded_bytes"] == first["save"]["saved_bytes"]
    assert second["load"]["entries"]["inductor"] == 1
    assert second["compiled"] == second["misses"] == second["bypasses"] == 0 and second["hits"] == 1
    assert second["autograd_hits"] == 1 and second["autograd_misses"] == 0
    assert second["graphs"] == 1  # dynamo still traces the function; inductor builds nothing
    assert not second["save"]["written"]  # the file already holds these bytes

    # a start that meets another shape compiles it alone, and keeps the one it loaded but did not use
    third = _start(uri, tmp_path / "inductor-3", 6)
    assert third["misses"] == 1 and third["hits"] == 0
    assert third["save"]["written"] and third["save"]["entries"]["inductor"] == 2
    fourth = _start(uri, tmp_path / "inductor-4", 4, 6)
    assert fourth["compiled"] == 0 and fourth["hits"] == 2
