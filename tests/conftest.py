"""Session fixtures: a real S3 endpoint (moto server on 127.0.0.1), one local Ray cluster, the
packaged tokenizers and tiny random models. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import uuid
from typing import Any

import pytest

# Two test files run at once on two cores (`make test`: -n 2), each with its Ray actors and
# subprocesses: one OpenMP thread a process (inherited by every process it starts), or each
# process's waiting threads spin on the cores the others need (two copies of test_speculative.py and
# test_dflash2.py at once: 664 s with torch's default two threads each, 106 s with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file by a plugin: its pool is already made
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_ports = random.Random(os.getpid())
_given: set[int] = set()
# `make test` runs two pytest workers at once (pytest-xdist): each draws its ports from its own range
_worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_PORTS = range(20000 + _worker * 12000 // _workers, 20000 + (_worker + 1) * 12000 // _workers)


# A test that asks for one of these is an integration test; so is one marked by hand (a vLLM engine,
# a CLI in a subprocess). `make test-fast` runs the others: no Ray, S3 server or engine.
INTEGRATION_FIXTURES = {"ray_cluster", "s3_endpoint", "s3_bucket", "three_nodes", "autoscaling_head"}
INTEGRATION_FILES = {"test_job_submit.py", "test_local_cluster.py", "test_vllm_export.py", "test_gpu_check.py"}


# The files that take longest, longest first: `make test` runs two files at a time (pytest-xdist,
# a file to a worker, in this order), and a long file started last would finish alone.
LONGEST_FIRST = (
    "test_train.py",
    "test_chaos.py",
    "test_train_guards.py",
    "test_clocks.py",
    "test_long_run.py",
    "test_cold_start.py",
    "test_vllm_export.py",
    "test_job_submit.py",
    "test_generate_actors.py",
    "test_tokenize_validate.py",
    "test_responses.py",
    "test_onesample.py",
    "test_autoscale.py",
    "test_engine_memory.py",
    "test_speculative.py",
    "test_trackers.py",
    "test_gpu_check.py",
    "test_plan.py",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if INTEGRATION_FIXTURES & set(item.fixturenames) or item.path.name in INTEGRATION_FILES:
            item.add_marker(pytest.mark.integration)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# What makes a test an integration test at run time, where no fixture says so: `make test-fast`
# (which leaves integration out) fails such a test unmarked, naming the mark it lacks.
_SLOW_PROGRAMS = ("python", "dflash-ray", "ray", "vllm")


def _unmarked(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"this test {what} but is not marked integration: add @pytest.mark.integration")

    return refuse


def fast_loop_guards(monkeypatch) -> None:
    """A Ray cluster, a vLLM engine or a Python (or CLI) subprocess refused, each naming the mark."""
    import subprocess

    import ray

    from dflash_ray import hf_load

    monkeypatch.setattr(ray, "init", _unmarked("starts Ray"))
    monkeypatch.setattr(hf_load, "vllm_engine", _unmarked("starts a vLLM engine"))
    popen_init = subprocess.Popen.__init__

    def checked(self, args, *rest, **kwargs):
        program = os.path.basename(str(args if isinstance(args, (str, os.PathLike)) else args[0]).split()[0])
        if program.startswith(_SLOW_PROGRAMS):
            _unmarked(f"runs {program} in a subprocess")()
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked)


@pytest.fixture(autouse=True)
def _fast_loop_guard(request, monkeypatch):
    """Guards each test not marked integration, where integration is left out (`make test-fast`)."""
    if request.node.get_closest_marker("integration") is None and "not integration" in (
        request.config.getoption("markexpr") or ""
    ):
        fast_loop_guards(monkeypatch)


def small_qwen3_config(**overrides):
    """A Qwen3 config of four tiny layers and a 512-token vocabulary, for code that needs a target's
    config and no weights (or builds its own from it)."""
    from transformers import Qwen3Config

    small = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return Qwen3Config(**{**small, **overrides})


# What a spawned rank imports before it runs: loaded once in the fork server, not once a rank
RANK_PRELOAD = ["torch", "torch.distributed", "transformers", "dflash_ray.train.fsdp", "dflash_ray.train.p2p"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn`'s ranks, forked from a server that imported torch and transformers
    once for the session's process, not started afresh: a fresh interpreter a rank spends 4-5 s of CPU
    on imports alone. Each rank is still a process of its own, as on GPUs (its own gloo group, its own
    exit code: a rank that dies raises `ProcessExitedException` here as spawn's does). A rank sees the
    environment and the stdio the server started with, not the caller's now: a test that reads its
    ranks' stderr (capfd) or sets a variable for them after the server started uses `mp.spawn`."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts: the first call
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def free_port() -> int:
    """A port that binds now, drawn below the kernel's ephemeral range (32768 and up) and above Ray's
    worker ports (10002-19999): between this check and the server's own bind, no outgoing connection
    of any process can be given it, and no two calls of one session (or two of its workers) return
    the same port."""
    while True:
        port = _ports.choice(_PORTS)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1; the AWS environment points at it (Ray workers inherit it)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "4",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield endpoint
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket per test; returns its `s3://` URI."""
    from dflash_ray import s3

    name = f"t-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def ray_cluster(s3_endpoint):
    """One local Ray cluster for the session: 2 CPUs, a capped object store, no dashboard."""
    import ray

    # "local": never the cluster a test started with `ray start` (ray.init alone would join it)
    ray.init(
        address="local", num_cpus=2, object_store_memory=256 * 1024**2, include_dashboard=False, log_to_driver=False
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from dflash_ray.registry import load_tokenizer

    return load_tokenizer("qwen3")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from dflash_ray.registry import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from dflash_ray.tiny_models import tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen35_dir(tmp_path_factory):
    from dflash_ray.tiny_models import tiny_qwen35

    return tiny_qwen35(tmp_path_factory.mktemp("tiny-qwen35"))


_PROBE = """
import sys, time
import ray
address, nodes = sys.argv[1], int(sys.argv[2])
while True:
    try:
        ray.init(address=address, log_to_driver=False)
        break
    except Exception:
        time.sleep(1)
while sum(1 for n in ray.nodes() if n["Alive"]) < nodes:
    time.sleep(0.5)
"""


def wait_for_nodes(address: str, env: dict, nodes: int, procs: list, timeout_s: float = 300) -> bool:
    """Whether `nodes` nodes of the cluster at `address` (GCS host:port) are alive within
    `timeout_s`; False as soon as one of `procs` (the nodes' `ray start` processes) exits. One
    driver process waits, polling from inside: a fresh Python and Ray import every poll would cost
    a busy 2-core machine seconds of CPU each."""
    import subprocess
    import sys
    import tempfile
    import time

    log = tempfile.TemporaryFile("w+")  # not a pipe: a retrying probe's warnings could fill one
    probe = subprocess.Popen(
        [sys.executable, "-c", _PROBE, address, str(nodes)], env=env, stdout=subprocess.DEVNULL, stderr=log, text=True
    )
    deadline = time.time() + timeout_s
    try:
        while probe.poll() is None:
            if any(proc.poll() is not None for proc in procs):
                return False
            assert time.time() < deadline, f"{nodes} nodes did not come up at {address} in {timeout_s:.0f} s"
            time.sleep(0.5)
        log.seek(0)
        assert probe.returncode == 0, f"the probe of {address} failed: {log.read()[-2000:]}"
        return True
    finally:
        if probe.poll() is None:
            probe.kill()
        probe.wait()
        log.close()


# A killed raylet refuses the GCS's health checks at once; a check a second and five refusals find
# it dead in about 5 s instead of Ray's 15 (a live node misses five checks in a row only if stalled)
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}


def stop_nodes(procs: list, grace_s: float = 10) -> None:
    """Stop the nodes whose `ray start --block` processes are `procs`: each is asked to stop at
    once, and whatever of their process groups is left after `grace_s` is killed (a node that
    drains gracefully can take half a minute; its files are thrown away anyway)."""
    import signal
    import subprocess
    import time

    for proc in procs:
        proc.terminate()
    deadline = time.time() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@contextlib.contextmanager
def local_nodes(workers: list[tuple[str, int, dict]]):
    """A cluster of several nodes on this machine, apart from the session's: a head on 127.0.0.1
    (resource `head_node`, no CPUs) and a worker node per (address, CPUs, resources), token auth on.
    Yields (address, environment for a driver); every node is stopped by its process group.

    On a busy 2-core machine a head can take minutes to come up, and a worker node started before it
    is up gives up on it; so the workers start once the head answers, and each once the one before
    is up: nodes of one machine share the head's session folder, and two raylets starting at once
    can pick the same socket name there, the second aborting with "bind: Address already in use".
    A node that exits while the cluster comes up makes a fresh start of the whole cluster, up to
    three times."""
    import json
    import secrets
    import subprocess
    import sys
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
        **FAST_NODE_DEATH,
    }
    env.pop("RAY_ADDRESS", None)

    def own_ports():  # the session's other local cluster holds the default ones
        return [
            f"--{name}-port={free_port()}"
            for name in (
                "dashboard-agent-listen",
                "dashboard-agent-grpc",
                "metrics-export",
                "runtime-env-agent",
                "node-manager",
                "object-manager",
            )
        ]

    def start(args, log=subprocess.DEVNULL):
        return subprocess.Popen(
            [str(bin_dir / "ray"), "start", "--block", *args, *own_ports()],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    for attempt in range(3):
        port = free_port()
        address = f"127.0.0.1:{port}"
        temp = f"/tmp/ray2n-{secrets.token_hex(3)}"  # short: Ray's socket paths have a length limit
        procs = [
            start(
                [
                    "--head",
                    "--node-ip-address=127.0.0.1",
                    f"--port={port}",
                    "--num-cpus=0",
                    '--resources={"head_node": 1}',
                    "--include-dashboard=false",
                    f"--temp-dir={temp}",
                    f"--ray-client-server-port={free_port()}",
                ]
            )
        ]
        try:
            # the workers join a head that is up (one started earlier gives up on it)
            ok = wait_for_nodes(address, env, 1, procs)
            for ip, cpus, resources in workers if ok else []:  # one at a time: see above
                procs.append(
                    start(
                        [
                            f"--address={address}",
                            f"--node-ip-address={ip}",
                            f"--num-cpus={cpus}",
                            f"--resources={json.dumps(resources)}",
                        ]
                    )
                )
                ok = wait_for_nodes(address, env, len(procs), procs)
                if not ok:
                    break
        except BaseException:
            stop_nodes(procs)
            raise
        if ok:
            break
        stop_nodes(procs)
        assert attempt < 2, "a node exited while the cluster came up, three times"
    cluster = LocalNodes((address, env))
    cluster.start, cluster.procs = start, procs
    cluster.ips = ["127.0.0.1"] + [ip for ip, _, _ in workers]
    try:
        yield cluster
    finally:
        stop_nodes(procs)


class LocalNodes(tuple):
    """What `local_nodes` yields: (address, environment for a driver), and its nodes' processes:
    `lost()` names the nodes whose process has exited (a drill killed it), `add` starts a node."""

    start: Any
    procs: list
    ips: list

    def lost(self) -> list[str]:
        return [ip for ip, proc in zip(self.ips, self.procs) if proc.poll() is not None]

    def add(self, ip: str, cpus: int, resources: dict) -> None:
        """A worker node on `ip` (one that was lost, say), joined and alive on return. A busy
        machine can time a node's start out ("the GCS has become overloaded"): up to three tries."""
        import json
        import tempfile

        args = [f"--address={self[0]}", f"--node-ip-address={ip}", f"--num-cpus={cpus}"]
        for attempt in range(3):
            log = tempfile.TemporaryFile("w+")  # what `ray start` said, should the node not come up
            proc = self.start([*args, f"--resources={json.dumps(resources)}"], log)
            self.procs.append(proc)
            self.ips.append(ip)
            alive = len(self.procs) - len(self.lost())
            if wait_for_nodes(self[0], self[1], alive, [proc]):
                return
            log.seek(0)
            said = log.read()[-3000:]
        raise AssertionError(f"{ip} did not join in three tries: {said}")


def checkpoint_weights(output: str) -> tuple[int, bytes]:
    """The newest complete checkpoint of a run: its step and its whole drafter weights, assembled
    from every rank's shard (safetensors bytes: equal bytes, equal weights bit for bit)."""
    from safetensors.torch import save

    from dflash_ray.train import checkpoint, checkpoint_files

    step = checkpoint.complete_steps(output)[-1]
    drafter, _ = checkpoint_files.assemble(checkpoint.step_dir(output, step))
    return step, save({k: v.contiguous() for k, v in drafter.state_dict().items()})


@contextlib.contextmanager
def joined_stream(target: str, cfg, init: str):
    """A target actor and its drafter actor of one stream (`train.num_streams=1`), joined over a
    free port: (target, drafter, layout). Both are killed on the way out: actors left alive would
    hold the test cluster's CPUs from every later test."""
    import json

    import ray

    from dflash_ray.train.handoff import Layout
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.train.streams import free_port
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    layout = Layout(streams=1, teams=1)
    sender = ray.remote(TargetWorker).options(num_cpus=0.5).remote(target, [0, 1, 2], cfg.train)
    config = json.dumps(drafter_config(target, cfg))
    receiver = ray.remote(DrafterWorker).options(num_cpus=0.5).remote(target, config, init, cfg.train, 0, 1)
    try:
        port = free_port()
        ray.get([r.join_run.remote("127.0.0.1", port, 0, layout) for r in (sender, receiver)])
        yield sender, receiver, layout
    finally:
        ray.kill(sender)
        ray.kill(receiver)
