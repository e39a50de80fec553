"""`ray job submit` as from a laptop against a cluster laid out as cluster.yaml's: a CPU head, a
generation node and a training node, three `ray start` processes on this machine with token auth
on every node. A small pipeline is submitted with the CLI, its generators are scaled mid-run by a
second submitted job; then the job's own records say where each actor ran, and the nodes'
Prometheus export is checked against the Grafana dashboard.
"""

from __future__ import annotations

import collections
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import FAST_NODE_DEATH, free_port, stop_nodes, wait_for_nodes

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NAME = "job-test"


NODES = {"head_node": "127.0.0.1", "gen_node": "127.0.0.2", "train_node": "127.0.0.3"}


@pytest.fixture
def cluster():
    """Three nodes on this machine, as cluster.yaml lays them out: a CPU head (`head_node`, dashboard
    on 127.0.0.1, no CPUs for tasks), a generation node (`gen_node`) and a training node
    (`train_node`), each on a loopback address of its own and in its own process group; token auth
    on every node with a token of this test's own. Yields the dashboard address, the environment
    and each node's metrics export address."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_metrics_report_interval_ms": "1000",
        **FAST_NODE_DEATH,
        # the jobs' `python` is this environment's, as a cluster image's Python carries the package
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    dash, gcs = free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="rayjob-", dir="/tmp")  # short: Ray's socket paths have a length limit
    metrics: dict[str, str] = {}
    procs = []

    def start(resource: str, *args: str) -> None:
        port = free_port()
        metrics[resource] = f"http://{NODES[resource]}:{port}/metrics"
        procs.append(
            subprocess.Popen(
                [
                    str(BIN / "ray"),
                    "start",
                    "--block",
                    f"--node-ip-address={NODES[resource]}",
                    f"--resources={json.dumps({resource: 1})}",
                    f"--metrics-export-port={port}",
                    *args,
                    # ports of their own: the session's other local cluster holds the default ones
                    *(
                        f"--{name}-port={free_port()}"
                        for name in (
                            "dashboard-agent-listen",
                            "dashboard-agent-grpc",
                            "runtime-env-agent",
                            "node-manager",
                            "object-manager",
                        )
                    ),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    try:
        start(
            "head_node",
            "--head",
            f"--port={gcs}",
            "--num-cpus=0",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--temp-dir={temp}",
            f"--ray-client-server-port={free_port()}",
        )
        for worker in ("gen_node", "train_node"):  # a temp dir each: two raylets' sockets must not meet
            start(worker, f"--address=127.0.0.1:{gcs}", "--num-cpus=2", f"--temp-dir={temp}-{worker[:3]}")
        address = f"http://127.0.0.1:{dash}"
        assert wait_for_nodes(f"127.0.0.1:{gcs}", env, 3, procs, timeout_s=180), "a node exited as the cluster came up"
        deadline = time.time() + 120
        while _ray(env, "job", "list", "--address", address, check=False).returncode:  # the job server
            assert time.time() < deadline, "the dashboard's job server did not answer"
            time.sleep(2)
        yield address, env, metrics
    finally:
        stop_nodes(procs)
        for folder in (temp, f"{temp}-gen", f"{temp}-tra"):
            shutil.rmtree(folder, ignore_errors=True)


def _ray(env, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, cwd=ROOT, check=check)


def _submit(address: str, env, sid: str, *entry: str, wait: bool) -> subprocess.CompletedProcess:
    deadline = time.time() + 120
    while True:  # a fresh head answers before its job agent is up: "No available agent to submit job"
        done = _ray(
            env,
            "job",
            "submit",
            "--address",
            address,
            "--submission-id",
            sid,
            "--working-dir",
            ".",
            *([] if wait else ["--no-wait"]),
            "--",
            "python",
            *entry,
            check=False,
        )
        if "No available agent" not in done.stderr or time.time() > deadline:
            return done
        time.sleep(2)


class Scraper(threading.Thread):
    """Reads every node's Prometheus export once a second while a job runs (a gauge leaves the export
    when its actor ends): each sample's name with its label sets."""

    def __init__(self, urls: list[str]):
        super().__init__(daemon=True)
        self.urls, self.stop, self.seen = urls, threading.Event(), collections.defaultdict(set)

    def run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self.stop.wait(1.0):
            for url in self.urls:
                try:
                    text = urllib.request.urlopen(url, timeout=5).read().decode()
                except OSError:
                    continue
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if sample.name.startswith("ray_dflash_"):
                            self.seen[sample.name].add(frozenset(sample.labels.items()))


def dashboard_queries() -> list[tuple[str, set[str]]]:
    """(metric, label names it filters on) for every query of every panel of the Grafana dashboard."""
    board = json.loads((ROOT / "dashboards" / "grafana.json").read_text())
    queries = []
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            m = re.fullmatch(r"(?:rate\()?(ray_dflash_\w+)\{([^}]*)\}(?:\[\w+\]\))?", target["expr"])
            assert m, f"{panel['title']}: {target['expr']}"
            name, matchers = m.groups()
            assert name.endswith("_total") == target["expr"].startswith("rate("), (
                f"{panel['title']}: a counter is plotted as a rate, a gauge as it is"
            )
            queries.append((name, {x.split("=")[0].strip() for x in matchers.split(",")}))
    return queries


@pytest.mark.timeout(1800)
def test_pipeline_job_on_three_nodes_places_by_node_type_and_exports_every_plotted_metric(
    cluster, tmp_path, smollm2_tokenizer
):
    """The job runs through `ray job submit` with token auth on every node; its own records say
    where each actor ran: generators on the generation node only (even after a second one is added
    mid-run), stream actors on the training node only, the coordinator on the head. Every metric
    the Grafana dashboard plots is in the nodes' export with the labels its queries filter on."""
    from dflash_ray.stages.demo import bundled_inputs

    address, env, metrics = cluster
    scraper = Scraper(list(metrics.values()))
    scraper.start()
    work = tmp_path / "run"
    config = {
        "pipeline": {
            "inputs": bundled_inputs(small=True)[:1],
            "workdir": str(work),
            "target": "smollm2-135m-instruct",
            "eval_prompts": 2,
        },
        "ray": {"head_resource": "head_node"},
        "prompts": {"tokenizer": "smollm2-135m-instruct"},
        "tokenize": {"tokenizer": "smollm2-135m-instruct"},
        "generate": {
            "name": NAME,
            "generators": 1,
            "shard_size": 1,
            "max_tokens": 40,
            "max_model_len": 1024,
            "truncated": "keep",
            "node_resource": "gen_node",
            "start_paused": True,
        },
        "validate": {"gate": {"min_median_response": 8, "max_mode_share": 0.9}},  # answers cut at 40 tokens
        "train": {
            "num_streams": 1,
            "colocate": True,
            "actor_cpus": 0.5,
            "max_steps": 6,
            "num_anchors": 8,
            "checkpoint_every": 100,
            "heldout": 2,
            "eval_every": 2,
            "node_resource": "train_node",
        },
        "evaluate": {"max_new_tokens": 8},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    submitted = _submit(
        address,
        env,
        "pipeline-1",
        "jobs/run.py",
        "pipeline",
        "--config",
        str(tmp_path / "run.yaml"),
        "--json",
        wait=False,
    )
    assert submitted.returncode == 0, submitted.stderr

    # from the laptop: wait for the generation to show up, then scale it to 2 generators
    def generation_status(until) -> dict:
        deadline, status, probe = time.time() + 300, None, None
        while time.time() < deadline:
            probe = _submit(
                address,
                env,
                f"status-{int(time.time() * 1000)}",
                "jobs/run.py",
                "status",
                "--name",
                NAME,
                "--json",
                wait=True,
            )
            line = [x for x in probe.stdout.splitlines() if x.startswith('{"ok": true')]
            if line and until(status := json.loads(line[-1])):
                return status
            time.sleep(6)  # each look is a job of its own (a supervisor and a driver): seconds of CPU
        raise AssertionError(
            f"the generation never reached the state waited for; last {status}: "
            + probe.stdout[-1500:]
            + probe.stderr[-1500:]
            + _ray(env, "job", "logs", "--address", address, "pipeline-1", check=False).stdout[-3000:]
        )

    # the generation starts paused, so it is still there to scale, whoever is quick
    status = generation_status(lambda s: True)
    assert status["generators_target"] == 1 and status["paused"] and status["shards_done"] == 0
    scaled = _submit(
        address, env, "scale-1", "jobs/run.py", "scale", "generators", "2", "--name", NAME, "--json", wait=True
    )
    assert '"generators_target": 2' in scaled.stdout, scaled.stdout + scaled.stderr
    generation_status(lambda s: s["generators_alive"] == 2)
    resumed = _submit(address, env, "resume-1", "jobs/run.py", "resume", "--name", NAME, "--json", wait=True)
    assert '"paused": false' in resumed.stdout, resumed.stdout + resumed.stderr

    # `ray job logs --follow` returns when the job ends (or its stream drops): one process to wait
    # with, not a `ray job status` process every few seconds
    deadline = time.time() + 900
    while True:
        subprocess.run(
            [str(BIN / "ray"), "job", "logs", "--address", address, "--follow", "pipeline-1"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=max(1.0, deadline - time.time()),
        )
        state = _ray(env, "job", "status", "--address", address, "pipeline-1").stdout.upper()
        if any(s in state for s in ("SUCCEEDED", "FAILED", "STOPPED")) or time.time() > deadline:
            break
        time.sleep(3)
    logs = _ray(env, "job", "logs", "--address", address, "pipeline-1").stdout
    assert "SUCCEEDED" in state, logs[-3000:]
    summary = json.loads([x for x in logs.splitlines() if x.startswith('{"ok": true')][-1])
    assert summary["stage"] == "pipeline" and summary["completions"] > 0 and summary["lossless"]
    assert summary["vllm_outputs_equal"] is True and summary["tau_trained_vllm"] >= 1  # vLLM served the export
    generation = json.loads((work / "completions" / "_manifest.json").read_text())["summary"]
    assert generation["generators_started"] == 2 and generation["restarts"] == 0
    assert (work / "drafter" / "config.json").exists() and (work / "train" / "metrics.png").exists()

    assert summary["generator_nodes"] == [NODES["gen_node"]], summary
    assert summary["stream_nodes"] == [NODES["train_node"]], summary
    assert summary["coordinator_node"] not in (NODES["gen_node"], NODES["train_node"]), summary  # the head

    time.sleep(3)
    scraper.stop.set()
    scraper.join()
    for name, labels in dashboard_queries():
        assert name in scraper.seen, f"{name} is plotted but never exported (seen: {sorted(scraper.seen)})"
        assert any(labels <= {k for k, _ in tags} for tags in scraper.seen[name]), (name, scraper.seen[name])
    runs = {dict(tags)["run"] for tags in scraper.seen["ray_dflash_train_loss"]}
    assert len(runs) == 1 and runs != {""}, runs  # the training run's name, not a shared series
