"""A stream's cold start from S3: the weights in ranged reads run at once, resumable, once a node;
a drafter reads only the tensors it needs; the start-up's deadline follows the bytes arriving."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import free_port
from dflash_ray import model_fetch, storage
from dflash_ray.config import load_config
from dflash_ray.train.shape import drafter_config
from dflash_ray.tiny_models import tiny_qwen3

SETTINGS = ["train.num_layers=1", "train.target_layer_ids=[0,1,2]"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("target"), num_layers=4, hidden_size=64, vocab_size=512)


def _upload(folder: str, uri: str) -> str:
    storage.upload_tree(folder, uri)
    return uri


def test_ranged_reads_give_a_drafter_only_the_tensors_it_needs(target, s3_bucket, monkeypatch):
    """The drafter actor's own constructor on an s3:// target: the embedding, the head and the
    layers its start copies, each by its byte range; the bytes read are counted."""
    from dflash_ray import tensor_ranges
    from dflash_ray.train.workers import DrafterWorker

    uri = _upload(target, f"{s3_bucket}/target")
    cfg = load_config(None, SETTINGS)
    kept: dict[str, int] = {}  # each tensor the drafter asked for, and its bytes
    real = tensor_ranges._tensor

    def noted(uri, name, entry, data_start):
        kept[name] = entry["data_offsets"][1] - entry["data_offsets"][0]
        return real(uri, name, entry, data_start)

    monkeypatch.setattr(tensor_ranges, "_tensor", noted)
    before = storage.bytes_read()
    worker = DrafterWorker(uri, json.dumps(drafter_config(target, cfg)), "target", cfg.train, 0, 1)
    read = storage.bytes_read() - before

    need = sum(kept.values())
    whole = sum(p.stat().st_size for p in Path(target).glob("*.safetensors"))
    assert "model.embed_tokens.weight" in kept and any(".layers." in k for k in kept), sorted(kept)
    assert need < whole / 2, (need, whole)  # the target's other layers stay where they are
    assert need <= read <= 1.1 * need, (read, need)
    local = DrafterWorker(target, json.dumps(drafter_config(target, cfg)), "target", cfg.train, 0, 1)
    torch.testing.assert_close(worker.embed, local.embed, rtol=0, atol=0)
    for a, b in zip(worker.drafter.parameters(), local.drafter.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_ranged_fetch_killed_half_way_goes_on_with_the_chunks_it_lacks(target, s3_bucket, tmp_path, monkeypatch):
    uri = _upload(target, f"{s3_bucket}/target")
    monkeypatch.setenv("DFLASH_RAY_S3_CHUNK_MB", str(64 / 1024))  # 64 KiB ranges
    monkeypatch.setenv("DFLASH_RAY_S3_CONCURRENCY", "4")
    files = {storage.basename(f): storage.size(f) for f in storage.list_files(uri)}
    total = sum(files.values())
    real, calls = storage.read_range, [0]

    def dies_half_way(u, start, end):  # the node's process killed after half the ranges
        calls[0] += 1
        if calls[0] > total // (64 << 10) // 2:
            raise KeyboardInterrupt
        return real(u, start, end)

    monkeypatch.setattr(storage, "read_range", dies_half_way)
    dest = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        model_fetch.fetch_folder(uri, dest)
    monkeypatch.setattr(storage, "read_range", real)
    assert list(dest.glob("*.part")), "a file killed half way stays a .part, never under its own name"
    before = storage.bytes_read()
    done = model_fetch.fetch_folder(uri, dest)
    again = storage.bytes_read() - before
    assert done["fetched"] == again < 0.75 * total, (done, again, total)  # only what the first one lacked
    for name, size in files.items():
        assert (dest / name).read_bytes() == (Path(target) / name).read_bytes()
    assert not list(dest.glob("*.part*"))
    assert model_fetch.fetch_folder(uri, dest) == {"fetched": 0, "kept": total}


class ThrottlingProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server: its answers at `rate` bytes a second over
    every connection together; past `stall_after` bytes it answers nothing more (a store that hangs)."""

    def __init__(self, upstream: str, rate: float, stall_after: int | None = None):
        self.upstream = int(upstream.rsplit(":", 1)[1])
        self.rate, self.stall_after = rate, stall_after
        self.sent, self.lock, self.closed = 0, threading.Lock(), threading.Event()
        self.restart()
        self.server = socket.create_server(("127.0.0.1", free_port()))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def restart(self) -> None:
        """The rate's clock from now (no credit saved up while nothing was asked)."""
        with self.lock:
            self.sent, self.started = 0, time.monotonic()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(4096):
                if answers:
                    with self.lock:
                        if self.stall_after is not None and self.sent >= self.stall_after:
                            self.closed.wait()
                            return
                        self.sent += len(data)
                        due = self.started + self.sent / self.rate
                    time.sleep(max(0.0, due - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.closed.set()
        self.server.close()


def _fetching_actor(proxy: ThrottlingProxy, cache):
    """An actor on the slow store, started and idle: `fetch` resolves the target as a stream actor's
    constructor does (`registry.resolve`: the node's copy, fetched in ranged reads)."""
    import ray

    class Fetcher:
        def __init__(self):  # what a stream actor has done before it fetches: its imports, its client
            from dflash_ray import registry, s3

            self.resolve = registry.resolve
            s3.client()

        def fetch(self, uri: str) -> str:
            return self.resolve(uri)

    # small ranges, two at a time: at the proxy's rate one is in every fraction of a second, as 64 MB
    # ones are at a real store's (16 at once, each at ~80 MB/s)
    env = {
        "AWS_ENDPOINT_URL": proxy.url,
        "DFLASH_RAY_CACHE": str(cache),
        "DFLASH_RAY_S3_CHUNK_MB": str(16 / 1024),
        "DFLASH_RAY_S3_CONCURRENCY": "2",
    }
    actor = ray.remote(Fetcher).options(num_cpus=0, runtime_env={"env_vars": env}).remote()
    ray.get(actor.__ray_ready__.remote())
    return actor


FLOOR_S, PLACEMENT_S = 2.0, 1.0  # the start-up's old fixed deadline: 3 s


def test_deadline_a_slow_start_that_keeps_making_progress_is_not_killed(
    ray_cluster, s3_endpoint, target, s3_bucket, tmp_path
):
    """The weights arrive over 3x the old fixed deadline (floor + placement), a little at a time: the
    start-up goes on, and the folder is whole."""
    import ray

    from dflash_ray.train.deadlines import Deadlines

    uri = _upload(target, f"{s3_bucket}/target")
    size = sum(storage.size(f) for f in storage.list_files(uri))
    proxy = ThrottlingProxy(s3_endpoint, rate=size / (3.5 * (FLOOR_S + PLACEMENT_S)))
    try:
        actor = _fetching_actor(proxy, tmp_path / "cache")
        proxy.restart()
        started = time.monotonic()
        [folder] = Deadlines(FLOOR_S, 1.0).wait_progressing(
            [actor.fetch.remote(uri)], ["target 0"], "start-up", FLOOR_S + PLACEMENT_S
        )
        took = time.monotonic() - started
    finally:
        proxy.close()
    assert took > 3 * (FLOOR_S + PLACEMENT_S), took  # past the old deadline three times over
    for f in storage.list_files(uri):
        assert (Path(folder) / storage.basename(f)).read_bytes() == storage.read_bytes(f)
    ray.kill(actor)


def test_deadline_a_start_that_stops_making_progress_is_killed_within_the_floor(
    ray_cluster, s3_endpoint, target, s3_bucket, tmp_path
):
    """The store answers a third of the weights and then nothing: the start-up is named stuck
    within the floor of its last byte, and the log says it made no progress."""
    import ray

    from dflash_ray.train.deadlines import Deadlines, Stalled

    uri = _upload(target, f"{s3_bucket}/target")
    size = sum(storage.size(f) for f in storage.list_files(uri))
    proxy = ThrottlingProxy(s3_endpoint, rate=size / 4, stall_after=size // 3)
    deadlines = Deadlines(FLOOR_S, 1.0)
    try:
        actor = _fetching_actor(proxy, tmp_path / "cache")
        proxy.restart()
        with pytest.raises(Stalled) as e:
            deadlines.wait_progressing([actor.fetch.remote(uri)], ["target 0"], "start-up", 60.0)
        ended = time.monotonic()
        stalled_at = proxy.started + proxy.sent / proxy.rate  # when its last byte went out
    finally:
        proxy.close()
    assert e.value.late == ["target 0"] and "made no progress for 2 s" in str(e.value), str(e.value)
    # the floor, a second for the count to be published and one for the wait to look (and a margin)
    assert ended - stalled_at <= FLOOR_S + 3.5, ended - stalled_at
    assert deadlines.missed[0]["limit_s"] == FLOOR_S
    ray.kill(actor)


def test_compile_resume_a_warm_up_killed_half_way_compiles_only_the_rest(target, tmp_path, monkeypatch):
    """Under the GPU's clocks (each shape's first use a compile): the warm-up keeps what it compiled
    as it goes, so one killed after half its shapes leaves them saved, and the restart (a fresh
    process: a new drafter, an empty clock) loads them and compiles only the other half."""
    from dflash_ray.train import warmup
    from dflash_ray.train.workers import DrafterWorker

    monkeypatch.setattr(warmup, "SAVE_EVERY_S", 0.0)  # a save after every shape (a GPU's 10-60 s compiles)
    cfg = load_config(None, SETTINGS + ["train.clocks.scale=0.001", "train.length_bucket=8"])
    config = json.dumps(drafter_config(target, cfg))
    shapes = [(1, 8 * n, grad) for n in range(1, 5) for grad in (True, False)]
    cache = str(tmp_path / "run" / "compile-cache.bin")

    first = DrafterWorker(target, config, "random", cfg.train, 0, 1)
    real, met = first._forward, [0]

    def killed_half_way(*args, **kwargs):
        if met[0] == len(shapes) // 2:
            raise KeyboardInterrupt  # the actor killed mid warm-up
        met[0] += 1
        return real(*args, **kwargs)

    first._forward = killed_half_way
    with pytest.raises(KeyboardInterrupt):
        first.warm_up(shapes, cache)

    restart = DrafterWorker(target, config, "random", cfg.train, 0, 1)
    again = restart.warm_up(shapes, cache)
    assert again["shapes"] == len(shapes) and again["compiled"] == len(shapes) // 2, again
    assert len(restart.clock.compiled) == len(shapes)
    third = DrafterWorker(target, config, "random", cfg.train, 0, 1).warm_up(shapes, cache)
    assert third["compiled"] == 0, third  # a whole warm-up saved: nothing left to compile


def test_ranged_storage_check_measures_the_rate_a_training_node_reads_at(ray_cluster, target, s3_bucket):
    """`dflash-ray netcheck --storage URI`: the folder's files, largest first, read as
    a start-up reads them, on a node of the training's type; the figure is plan.storage_gb_per_s's."""
    from dflash_ray.stages.netcheck import run_storage_check

    uri = _upload(target, f"{s3_bucket}/target")
    largest = max(storage.list_files(uri), key=storage.size)
    measured = run_storage_check(load_config(None, []), uri, megabytes=1)
    total = sum(storage.size(f) for f in storage.list_files(uri))  # the largest file first, then the rest
    assert measured["files"][0] == largest and measured["bytes"] == min(total, 10**6)
    # a megabyte is less than one round of parallel reads: a rate, and no advice drawn from it
    assert measured["storage_gb_per_s"] > 0 and measured["set"] is None
