"""Generation on a real Ray cluster with real engines: a vLLM generator killed mid-run, a rerun that
does no work, and generators scaled 1 → 2 → 1 while the job runs. Every prompt id must come out
exactly once (a completion or a rejected record with its reason)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time

import pytest

from dflash_ray import manifest, storage
from dflash_ray.config import load_config
from dflash_ray.registry import SMOLLM2


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, ray_cluster):
    from dflash_ray.stages.prompts import run_prompts
    from dflash_ray.stages.demo import bundled_inputs

    out = str(tmp_path_factory.mktemp("prompts"))
    run_prompts(bundled_inputs(small=True), out, load_config(None, [f"prompts.tokenizer={SMOLLM2}"]), progress=False)
    return out


def _prompt_ids(uri: str) -> list[str]:
    return [r["id"] for r in manifest.read_rows(uri, ["id"], 10**6)]


def _output_ids(uri: str) -> tuple[list[str], list[str], list[str]]:
    """(completion ids, rejected ids, the generators that produced them)."""
    rows = manifest.read_rows(uri, ["id", "generator_id"], 10**6)
    rejected = [json.loads(x) for x in storage.read_text(storage.join(uri, "rejected.jsonl")).splitlines()]
    assert all(r["kind"] and r["reason"] for r in rejected)
    generators = {r["generator_id"] for r in rows} | {r["record"].get("generator_id") for r in rejected} - {None}
    return [r["id"] for r in rows], [r["id"] for r in rejected], generators


def _wait(pool_status, until, future, timeout: float = 300):
    """Poll the pool until `until` holds; a run that ended meanwhile raises its own error.
    Every state waited for is one the test made stable (a paused pool), never a passing moment."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if future.done():
            future.result()  # a failed run: its error, not a time-out
        try:
            status = pool_status()
        except Exception:  # the pool is not up yet
            status = None
        if status is not None and until(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting; last status {status}")


def _engines_up(n: int):
    """`n` generators alive, every one of them past its engine start (it asked for work)."""
    return lambda s: s["generators_alive"] == n and not s["generators_starting"]


@contextlib.contextmanager
def _started(name: str, prompts: str, output: str, overrides: list[str]):
    """A generation named `name` running in a thread: (its config, its future). Whatever the test's
    outcome, none of its actors outlives the test: a generation left paused by a failed test would
    hold the session cluster's CPUs for every test after it."""
    import ray

    from dflash_ray.generation.actors import NAMESPACE
    from dflash_ray.stages.generate import run_generate

    cfg = load_config(
        None,
        [
            f"generate.name={name}",
            "generate.shard_size=2",
            "generate.max_tokens=24",
            "generate.max_model_len=1024",
            *overrides,
        ],
    )
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(run_generate, prompts, output, SMOLLM2, cfg, progress=False)
    try:
        yield cfg, future
    finally:
        if not future.done():
            for actor in ray.util.list_named_actors(all_namespaces=True):
                if actor["namespace"] == NAMESPACE and (actor["name"] == name or actor["name"].startswith(f"{name}-")):
                    ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.mark.timeout(900)  # two vLLM engines start on 2 CPUs: minutes on a busy machine
def test_killed_vllm_generator_loses_nothing_and_a_rerun_does_no_work(prompts, s3_bucket, tmp_path):
    import ray

    from dflash_ray.generation.actors import NAMESPACE
    from dflash_ray.stages.generate import pause, run_generate, status

    output = f"{s3_bucket}/completions"
    with _started("gen-kill", prompts, output, ["generate.generators=2", "generate.start_paused=true"]) as (
        cfg,
        future,
    ):
        # both engines loaded, neither has a shard
        held = _wait(lambda: status(cfg), _engines_up(2), future, timeout=600)
        assert held["paused"] and held["shards_done"] == 0 and not held["leased_by"]
        resumed = pause(False, cfg)  # both held lease calls take a shard at once
        assert not resumed["paused"] and sorted(resumed["leased_by"]) == ["g0", "g1"]
        victim = "g0"  # holds a shard right now: its first takes longer than these two calls
        ray.kill(ray.get_actor(f"gen-kill-{victim}", namespace=NAMESPACE))
        summary = future.result(timeout=600)

    assert summary["restarts"] == 1 and victim in summary["deaths"][0]
    completions, rejected, generators = _output_ids(output)
    assert sorted(completions + rejected) == sorted(_prompt_ids(prompts))  # each id exactly once
    assert summary["completions"] == len(completions) > 0 and summary["rejected"] == len(rejected)
    assert {"g0", "g1"} - {victim} <= generators
    listed = {storage.basename(f) for f in manifest.dataset_files(output)}
    on_storage = {storage.basename(f) for f in storage.list_files(output, ".parquet")}
    assert listed == on_storage  # nothing of the killed generator is left behind

    stored = status(cfg, output)  # a finished run's figures, from storage
    assert stored["complete"] and stored["shards_done"] == summary["shards"]
    assert stored["completions"] == summary["completions"]

    again = run_generate(prompts, output, SMOLLM2, cfg, progress=False)
    assert again["shards_run"] == 0 and again["generators_started"] == 0
    assert again["completions"] == summary["completions"]

    # the same file names holding other prompts (as a pipeline rerun on new inputs writes its
    # prompts-train split): refused before any engine starts, naming the change, not reused
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_ray.errors import DFlashError

    rewritten = str(tmp_path / "prompts")
    shutil.copytree(prompts, rewritten)
    shard = manifest.dataset_files(rewritten)[0]
    rows = pq.read_table(shard).to_pylist()
    for row in rows:
        row["messages"][-1]["content"] = "In one word: " + row["messages"][-1]["content"]
    pq.write_table(pa.Table.from_pylist(rows, pq.read_schema(shard)), shard)
    manifest.write_manifest(
        rewritten, kind="prompts", files=[{"name": storage.basename(shard), "rows": len(rows)}], summary={}
    )
    with pytest.raises(DFlashError, match="prompts' content"):
        run_generate(rewritten, output, SMOLLM2, cfg, progress=False)

    # the tokenizer replays the engine's own ids
    from dflash_ray.stages.tokenize import run_tokenize

    tok_cfg = load_config(None, [f"tokenize.tokenizer={SMOLLM2}"])
    tokenized = run_tokenize(output, f"{s3_bucket}/tokenized", tok_cfg)
    assert tokenized["rows_out"] == len(completions) and tokenized["rejected"] == 0


def test_scaling_one_two_one_mid_run_loses_and_duplicates_nothing(prompts, tmp_path):
    from dflash_ray.stages.generate import pause, scale, status

    output = str(tmp_path / "completions")
    with _started(
        "gen-scale",
        prompts,
        output,
        [
            "generate.generators=1",
            "generate.backend=transformers",
            "generate.shard_size=1",
            "generate.max_tokens=4",
            "generate.truncated=keep",
            "generate.start_paused=true",
        ],
    ) as (cfg, future):
        _wait(lambda: status(cfg), _engines_up(1), future)
        pause(False, cfg)
        _wait(lambda: status(cfg), lambda s: s["shards_done"] >= 2, future)
        pause(True, cfg)  # g1's engine starts while g0 waits: g0 cannot finish the run first
        assert scale(2, cfg)["generators_target"] == 2
        _wait(lambda: status(cfg), _engines_up(2), future)
        pause(False, cfg)
        _wait(lambda: status(cfg), lambda s: s["done_by"].get("g1", 0) >= 1, future)
        paused = pause(True, cfg)  # work is left: g1 has done one of 48 shards, g0 a few
        left = paused["shards_total"] - paused["shards_done"]
        assert left > paused["shards_leased"]
        scale(1, cfg)
        mid = _wait(lambda: status(cfg), lambda s: s["generators_alive"] == 1 and not s["leased_by"], future)
        assert mid["generators"] == ["g0"] and not mid["finished"]  # g1 drained while work was still left
        assert mid["shards_done"] < mid["shards_total"]
        pause(False, cfg)
        summary = future.result(timeout=600)

    assert summary["restarts"] == 0 and summary["generators_started"] == 2
    completions, rejected, generators = _output_ids(output)
    assert sorted(completions + rejected) == sorted(_prompt_ids(prompts))
    assert generators == {"g0", "g1"}
