"""`ray job submit` as from a laptop: a real head (`ray start --head`, token auth on, dashboard on
127.0.0.1), a small pipeline submitted with the CLI, its generators scaled mid-run by a second
submitted job, then the job's status and outputs checked, and the head stopped."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NAME = "job-test"


@pytest.fixture
def head():
    """A Ray head in its own process group; token auth with a token of this test's own."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0",
           # the jobs' `python` is this environment's, as a cluster image's Python carries the package
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in ("RAY_ADDRESS",):
        env.pop(key, None)
    dash = free_port()
    temp = tempfile.mkdtemp(prefix="rayjob-", dir="/tmp")  # short: Ray's socket paths have a length limit
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--temp-dir={temp}",
         # ports of their own: the session's other local cluster holds the default ones
         *(f"--{name}-port={free_port()}" for name in (
             "dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export", "runtime-env-agent",
             "ray-client-server", "node-manager", "object-manager"))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=env,
                         capture_output=True).returncode != 0:
        assert time.time() < deadline and proc.poll() is None, "the head did not come up"
        time.sleep(1)
    yield address, env
    proc.terminate()  # --block: the head drains and stops the processes it started
    try:
        proc.wait(timeout=90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its process group
        except ProcessLookupError:
            pass
        shutil.rmtree(temp, ignore_errors=True)


def _ray(env, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, cwd=ROOT,
                          check=check)


def _submit(address: str, env, sid: str, *entry: str, wait: bool) -> subprocess.CompletedProcess:
    deadline = time.time() + 120
    while True:  # a fresh head answers before its job agent is up: "No available agent to submit job"
        done = _ray(env, "job", "submit", "--address", address, "--submission-id", sid, "--working-dir", ".",
                    *([] if wait else ["--no-wait"]), "--", "python", *entry, check=False)
        if "No available agent" not in done.stderr or time.time() > deadline:
            return done
        time.sleep(2)


@pytest.mark.timeout(1800)
def test_pipeline_job_with_generators_scaled_mid_run(head, tmp_path, smollm2_tokenizer):
    from dflash_ray.demo import bundled_inputs

    address, env = head
    work = tmp_path / "run"
    config = {
        "pipeline": {"inputs": bundled_inputs(small=True)[:1], "workdir": str(work),
                     "target": "smollm2-135m-instruct", "eval_prompts": 2},
        "prompts": {"tokenizer": "smollm2-135m-instruct"}, "tokenize": {"tokenizer": "smollm2-135m-instruct"},
        "generate": {"name": NAME, "generators": 1, "shard_size": 1, "max_tokens": 40, "max_model_len": 1024,
                     "truncated": "keep"},
        "validate": {"gate": {"min_median_response": 8, "max_mode_share": 0.9}},  # answers cut at 40 tokens
        "train": {"num_streams": 1, "actor_cpus": 0.5, "max_steps": 3, "num_anchors": 8, "checkpoint_every": 100},
        "evaluate": {"max_new_tokens": 8},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    submitted = _submit(address, env, "pipeline-1", "jobs/pipeline.py", "--config", str(tmp_path / "run.yaml"),
                        "--json", wait=False)
    assert submitted.returncode == 0, submitted.stderr

    # from the laptop: wait for the generation to show up, then scale it to 2 generators
    deadline, status = time.time() + 300, None
    while time.time() < deadline:
        probe = _submit(address, env, f"status-{int(time.time() * 1000)}", "jobs/status.py", "--name", NAME,
                        "--json", wait=True)
        line = [x for x in probe.stdout.splitlines() if x.startswith('{"ok": true')]
        if line:
            status = json.loads(line[-1])
            break
        time.sleep(2)
    assert status is not None and status["generators_target"] == 1, "the generation never started"
    scaled = _submit(address, env, "scale-1", "jobs/scale.py", "generators", "2", "--name", NAME, "--json",
                     wait=True)
    assert '"generators_target": 2' in scaled.stdout, scaled.stdout + scaled.stderr

    deadline = time.time() + 900
    while time.time() < deadline:
        state = _ray(env, "job", "status", "--address", address, "pipeline-1").stdout.upper()
        if any(s in state for s in ("SUCCEEDED", "FAILED", "STOPPED")):
            break
        time.sleep(3)
    logs = _ray(env, "job", "logs", "--address", address, "pipeline-1").stdout
    assert "SUCCEEDED" in state, logs[-3000:]
    summary = json.loads([x for x in logs.splitlines() if x.startswith('{"ok": true')][-1])
    assert summary["stage"] == "pipeline" and summary["completions"] > 0 and summary["lossless"]
    generation = json.loads((work / "completions" / "_manifest.json").read_text())["summary"]
    assert generation["generators_started"] == 2 and generation["restarts"] == 0
    assert (work / "drafter" / "config.json").exists() and (work / "train" / "metrics.png").exists()
