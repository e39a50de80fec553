"""One stuck actor among others that still move: each actor of a start-up or warm-up has its own
deadline, moved only by its own progress (`progress`, `Deadlines.wait_progressing`), so the stuck
one is named, with its node and what it was doing, within its own deadline; with one sum for the
job it was named only a floor after the last healthy actor's progress."""

from __future__ import annotations

import time
import uuid

import pytest

FLOOR_S = 2.0
STAGE = "loading the target from the node's disk"


def _loader():
    """The actors' class, made here: a test module is not importable in Ray's workers."""

    class Loader:
        """A stream actor's start-up in small: it tells its progress under its actor name."""

        def load(self, seconds: float, stops_after: float) -> None:
            """Tell a MB of progress every 0.2 s for `stops_after` seconds, then nothing, until `seconds`."""
            from dflash_ray import progress

            start = time.monotonic()
            with progress.doing(STAGE):
                while time.monotonic() - start < seconds:
                    if time.monotonic() - start < stops_after:
                        progress.add(1 << 20)
                    time.sleep(0.2)

        def fetch_once_per_node(self, lock_path: str, seconds: float) -> None:
            """Fetch the node's one copy (`seconds` of progress) under the node's lock, or wait for it."""
            from filelock import FileLock

            from dflash_ray import progress

            with progress.node_shared(FileLock(lock_path), "fetching the target to the node's disk"):
                start = time.monotonic()
                while time.monotonic() - start < seconds:
                    progress.add(1 << 20)
                    time.sleep(0.2)

    return Loader


def _actors(count: int) -> tuple[list, list[str]]:
    import ray

    Loader = _loader()

    names = [f"stuck-actor-{uuid.uuid4().hex[:8]}-{i}" for i in range(count)]
    actors = [ray.remote(Loader).options(name=n, num_cpus=0).remote() for n in names]
    ray.get([a.__ray_ready__.remote() for a in actors])  # the processes are up: the wait times the work
    return actors, names


def test_stuck_actor_is_named_with_its_node_and_stage_while_another_still_moves(ray_cluster):
    """Two actors load; one stops after a second while the other moves for 30 s: the stopped one
    alone is named, with its node and stage, a floor (plus a second to publish and one to look)
    after it stopped, not after the other one stops."""
    import ray

    from dflash_ray.train.deadlines import Deadlines, Stalled

    actors, names = _actors(2)
    node = ray.util.get_node_ip_address()
    deadlines = Deadlines(FLOOR_S, 1.0)
    started = time.monotonic()
    refs = [actors[0].load.remote(30.0, 30.0), actors[1].load.remote(30.0, 1.0)]
    with pytest.raises(Stalled) as e:
        deadlines.wait_progressing(refs, ["target 0", "drafter 0"], "start-up", 10.0, names, [node, node])
    took = time.monotonic() - started
    for actor in actors:
        ray.kill(actor)
    assert e.value.late == ["drafter 0"], str(e.value)
    assert f"drafter 0 (node {node}, {STAGE}) made no progress for 2 s" in str(e.value), str(e.value)
    # it stopped at 1 s: a floor, a second to publish, one to look, and a margin for a busy machine;
    # the sum of both (the wait before) moved on until the other's 30 s were over
    assert took <= 1.0 + FLOOR_S + 2.0 + 2.5, took
    assert deadlines.missed[0]["where"] == {"drafter 0": f"node {node}, {STAGE}"}


def test_stuck_actor_that_never_tells_is_named_where_it_was_placed(ray_cluster):
    """An actor that tells nothing (stuck in its start) is named after `first_s`, with the node its
    placement gave it, while the other moves."""
    import ray

    from dflash_ray.train.deadlines import Deadlines, Stalled

    actors, names = _actors(2)
    refs = [actors[0].load.remote(30.0, 30.0), actors[1].__ray_call__.remote(lambda _: time.sleep(30))]
    started = time.monotonic()
    with pytest.raises(Stalled) as e:
        Deadlines(FLOOR_S, 1.0).wait_progressing(refs, ["target 0", "target 1"], "start-up", 2.0, names, ["a", "b"])
    took = time.monotonic() - started
    for actor in actors:
        ray.kill(actor)
    assert e.value.late == ["target 1"], str(e.value)
    assert "target 1 (node b, told nothing yet) told no progress within 2 s" in str(e.value), str(e.value)
    assert took <= 2.0 + 2.5, took


def test_stuck_actor_check_spares_actors_waiting_for_their_nodes_one_copy(ray_cluster, tmp_path):
    """Two actors of a node share one fetch: the one waiting on the node's lock tells nothing of its
    own for longer than the floor, but moves with its node, and is not taken for stuck."""
    from dflash_ray.train.deadlines import Deadlines

    actors, names = _actors(2)
    lock = str(tmp_path / "node.lock")
    held_s = 1.5 * FLOOR_S
    refs = [a.fetch_once_per_node.remote(lock, held_s) for a in actors]
    started = time.monotonic()
    Deadlines(FLOOR_S, 1.0).wait_progressing(refs, ["target 0", "target 1"], "start-up", 10.0, names)
    assert time.monotonic() - started >= 2 * held_s - 0.5  # one after the other: the second waited


def test_stuck_actor_check_counts_a_load_from_the_nodes_disk(tmp_path):
    """A target's weight files are read through once, every byte counted as progress: a load from
    a slow disk moves."""
    from dflash_ray import hf_load, progress

    files = [tmp_path / "model-00001.safetensors", tmp_path / "model-00002.safetensors"]
    files[0].write_bytes(b"x" * (hf_load.READ_BLOCK + 5))
    files[1].write_bytes(b"y" * 7)
    progress.publish()  # where the session's Ray is up: the count as published now, not a second ago
    before = progress.seen()
    assert hf_load.read_through(files) == hf_load.READ_BLOCK + 12
    progress.publish()
    assert progress.seen() - before == hf_load.READ_BLOCK + 12
