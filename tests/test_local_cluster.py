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
