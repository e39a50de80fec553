"""The fast loop's rule (`make test-fast` runs what is not marked integration or slow): a test is
marked integration by what it uses, so the next test that starts a cluster is left out of the fast
loop without anyone remembering to mark it."""

import subprocess
import sys

import pytest

from conftest import INTEGRATION_FIXTURES, fast_loop_guards


def test_every_collected_test_that_takes_a_cluster_server_or_engine_fixture_is_marked_integration(request):
    """Over this session's tests (all of them under `make test`)."""
    unmarked = [
        item.nodeid
        for item in request.session.items
        if INTEGRATION_FIXTURES & set(item.fixturenames) and item.get_closest_marker("integration") is None
    ]
    assert unmarked == []


def test_the_fast_loop_refuses_ray_an_engine_and_a_python_subprocess_naming_the_mark(monkeypatch):
    import ray

    from dflash_ray import hf_load

    fast_loop_guards(monkeypatch)
    for start, what in [
        (lambda: ray.init(address="local"), "starts Ray"),
        (lambda: hf_load.vllm_engine("/nowhere"), "starts a vLLM engine"),
        (lambda: subprocess.run([sys.executable, "-c", "0"]), "runs python"),
        (lambda: subprocess.run("dflash-ray --help", shell=True), "runs dflash-ray"),
    ]:
        with pytest.raises(RuntimeError, match=f"{what}.*add @pytest.mark.integration"):
            start()
    assert subprocess.run(["true"]).returncode == 0  # a program that starts in a moment is no integration
