"""The cluster a command starts for itself listens on the loopback address alone. It runs in a
subprocess: the session's own cluster (conftest) stays the only one in the test process."""

import json
import os
import subprocess
import sys

SCRIPT = """
import json, psutil, ray
from dflash_ray.cluster import connect
from dflash_ray.config import RayConfig

connect(RayConfig(num_cpus=1))

@ray.remote
def where():
    return ray.util.get_node_ip_address()

me, listening = psutil.Process(), set()
for proc in [me, *me.children(recursive=True)]:  # the GCS, raylet, agents and workers it started
    try:
        listening |= {c.laddr.ip for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        pass
print(json.dumps({"node": ray.util.get_node_ip_address(), "task": ray.get(where.remote()),
                  "listening": sorted(listening)}))
ray.shutdown()
"""


def test_a_local_cluster_binds_to_loopback_only():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["node"] == result["task"] == "127.0.0.1"
    assert result["listening"], "no listening socket found"
    assert set(result["listening"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}, result["listening"]


QUIET = """
import json, time, ray
from dflash_ray.cli import summary_stdout
from dflash_ray.cluster import connect
from dflash_ray.config import RayConfig

with summary_stdout(True) as out:
    connect(RayConfig(num_cpus=1, include_dashboard=False))  # a local cluster forwards its workers' logs

    @ray.remote
    def speak():
        print("a worker's line", flush=True)

    ray.get(speak.remote())
    print("the driver's line", flush=True)
    time.sleep(5)  # Ray's log thread forwards the worker's line meanwhile
print(json.dumps({"ray_up": ray.is_initialized()}), file=out, flush=True)
"""


def test_a_json_summary_is_the_only_line_on_stdout_with_a_local_cluster():
    """`cli.summary_stdout` (every command's `--json`, and the benchmarks that start Ray): what the
    driver and Ray's workers print goes to stderr, and Ray is down before the summary is written."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ['{"ray_up": false}'], proc.stdout[-3000:]
    assert "a worker's line" in proc.stderr and "the driver's line" in proc.stderr


RUNNING = """
import sys, ray
from dflash_ray.cluster import connect
from dflash_ray.config import GenerateConfig, RayConfig
from dflash_ray.generation.actors import NAMESPACE, ShardPool

connect(RayConfig(num_cpus=1, include_dashboard=False))  # as a local `generate` starts its cluster
name = sys.argv[1]
pool = ShardPool.options(name=name, namespace=NAMESPACE).remote(
    [{"index": 0, "count": 3}, {"index": 1, "count": 3}],
    {},
    GenerateConfig(name=name, generators=1, generator_cpus=0.5),  # room for two on the 1-CPU cluster
    "unused",
    {},
)
ray.get(pool.status.remote())
print("READY", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_status_and_scale_reach_a_generation_on_the_local_cluster(tmp_path):
    """During a local generation (its cluster on 127.0.0.1), `status` and `scale` from another process
    on the machine find its cluster, answer within seconds, and scale it; a name that runs nowhere is
    said, as quickly; the record of the cluster goes with its process."""
    import time
    import uuid

    from dflash_ray.cluster import records_dir

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    name = f"local-{uuid.uuid4().hex[:8]}"
    run = subprocess.Popen(
        [sys.executable, "-c", RUNNING, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert run.stdout is not None and run.stdout.readline().strip() == "READY"
        record = records_dir() / f"{run.pid}.json"
        assert json.loads(record.read_text())["address"].startswith("127.0.0.1:")

        def command(*args):
            start = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "dflash_ray.cli", *args, "--json"], capture_output=True, text=True, env=env
            )
            return done.returncode, json.loads(done.stdout.strip().splitlines()[-1]), time.monotonic() - start

        code, status, seconds = command("status", "--name", name)
        assert code == 0 and status["generators_target"] == 1 and status["prompts_total"] == 6, status
        assert seconds < 30
        code, scaled, _ = command("scale", "generators", "2", "--name", name)
        assert code == 0 and scaled["generators_target"] == 2 and scaled["bounded"] is None, scaled
        code, scaled, _ = command("scale", "generators", "10000", "--name", name)
        assert code == 0 and scaled["generators_target"] == 2 and "2 shards are left" in scaled["bounded"], scaled
        code, missing, seconds = command("status", "--name", f"{name}-not")
        assert code == 2 and "is running on this machine" in missing["error"] and seconds < 30, missing
    finally:
        run.communicate(timeout=60)
    assert not record.exists()


STOPPED = """
import faulthandler, signal, sys, time
from dflash_ray.cli import main
from dflash_ray.cluster import connect
from dflash_ray.config import RayConfig
from dflash_ray.stages import plan

def long_stage(*args, **kwargs):  # a long command on a cluster of its own: Ray installs its SIGTERM handler
    connect(RayConfig(num_cpus=1, include_dashboard=False))
    print("READY", file=sys.stderr, flush=True)
    # in short waits, as a stage's waits on Ray return to Python: a signal that lands on one of Ray's
    # threads runs its handler at the main thread's next return, which one 900 s sleep puts off
    for _ in range(1800):
        time.sleep(0.5)

plan.run_plan = long_stage
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's look at a command that does not stop
sys.exit(main(["plan", "--json"]))
"""


def test_sigterm_stops_a_command_as_ctrl_c_does_with_exit_143():
    """SIGTERM (Kubernetes, `ray job stop`) during a command that started its own cluster: the
    command stops as on Ctrl-C, saying so, with the --json line and exit 143, not through Ray's
    handler; Ctrl-C still exits 130."""
    import signal
    import time

    def as_in_a_terminal():
        # a command in a terminal's foreground takes Ctrl-C; one a non-interactive shell started with `&`
        # (a suite run in the background) inherits SIGINT ignored, and Python keeps it ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for sent, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        proc = subprocess.Popen(
            [sys.executable, "-c", STOPPED],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=as_in_a_terminal,
        )
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.strip() == "READY":
                break
        start = time.monotonic()
        proc.send_signal(sent)
        try:
            out, err = proc.communicate(timeout=300)  # a loaded 2-core machine stops a local cluster slowly
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack, on its stderr
            time.sleep(5)
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"still running 300 s after {sent.name}; its threads then:\n{err[-8000:]}") from None
        summary = json.loads(out.strip().splitlines()[-1])
        assert proc.returncode == summary["exit_code"] == code, (proc.returncode, summary, err[-2000:])
        assert "interrupted" in summary["error"] and ("SIGTERM: " in summary["error"]) == (code == 143)
        assert "Traceback" not in err and time.monotonic() - start < 240  # well before the stage's own end
