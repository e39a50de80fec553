"""`p2p.Ledger` holds two gloo processes to NCCL's point-to-point rules: a send completes only once
its receive is posted, pairs match by order, a device synchronization waits for the rank's own
unmatched sends and raises past the timeout, and a send left unmatched too long ends its process from
the ledger's watchdog thread (counted from the post, whatever the rank does next) and raises at the
rank's next call."""

import datetime
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import pytest
import torch.multiprocessing as mp

from conftest import free_port, spawn

# Scenarios that let a send go past the timeout to see what the rank's own calls say: the watchdog
# thread records its message there instead of ending the process.
RECORDED = {"no_greeting", "sync_waits_for_own_send", "watchdog"}


def _no_greeting(rank: int, timeout_s: float, out: dict, results: dict) -> None:
    from dflash_ray.train import handoff, p2p

    if rank == 0:
        try:  # the pair's first message, while the peer waits elsewhere: NCCL blocks both
            handoff.send({"a": torch.arange(4.0)}, [1])
        except p2p.NcclRuleError as e:
            out["error"] = str(e)


def _matched(rank: int, timeout_s: float, out: dict, results: dict) -> Any:
    from dflash_ray.train import handoff
    from dflash_ray.train.devices import synchronize

    sent = None
    if rank == 0:
        sent = handoff.send({"a": torch.arange(4.0), "b": torch.ones(2, 3)}, [1])
        out["done_before"] = sent.done()  # gloo has taken the bytes; the receive is not posted
        dist.barrier()  # rank 1 posts its receives after this
        dist.barrier()
        out["done_after"] = sent.done()
        synchronize("cpu")  # returns at once: every send is matched
    else:
        dist.barrier()
        got = handoff.receive({"a": ([4], "torch.float32"), "b": ([2, 3], "torch.float32")}, 0, "cpu")
        out["got"] = [got["a"].tolist(), got["b"].tolist()]
        dist.barrier()
    return sent


def _sync_waits_for_own_send(rank: int, timeout_s: float, out: dict, results: dict) -> Any:
    from dflash_ray.train import handoff, p2p
    from dflash_ray.train.devices import synchronize, wait_compute

    sent = None
    if rank == 0:
        sent = handoff.send({"a": torch.arange(4.0)}, [1])
        wait_compute("cpu")  # the compute stream alone: never waits on a peer
        time.sleep(0.5)  # the send's watchdog then runs out while the synchronization waits
        start = time.monotonic()
        try:
            synchronize("cpu")  # the peer waits for us below: on GPUs a hang
        except p2p.NcclRuleError as e:
            out["error"] = str(e)
        out["waited"] = time.monotonic() - start
        dist.barrier()
    else:
        dist.barrier()  # waits for rank 0, which waits for this rank's receive
        handoff.receive({"a": ([4], "torch.float32")}, 0, "cpu")
    return sent


def _watchdog(rank: int, timeout_s: float, out: dict, results: dict) -> Any:
    from dflash_ray.train import handoff, p2p

    sent = None
    if rank == 0:
        sent = handoff.send({"a": torch.arange(4.0)}, [1])
        out["posted"] = time.monotonic()
        time.sleep(timeout_s + 1.0)  # idle: the thread fires meanwhile, the next call raises
        try:
            handoff.send({"a": torch.arange(4.0)}, [1])
        except p2p.NcclRuleError as e:
            out["error"] = str(e)
    dist.barrier()
    if rank == 1:
        handoff.receive({"a": ([4], "torch.float32")}, 0, "cpu")
    return sent


def _watchdog_idle(rank: int, timeout_s: float, out: dict, results: dict) -> Any:
    """What a target does after its evaluation sends: nothing."""
    from dflash_ray.train import handoff

    sent = None
    if rank == 0:
        sent = handoff.send({"a": torch.arange(4.0)}, [1])
        results[rank] = {"posted": time.time()}
    time.sleep(30)  # rank 1 never receives; neither makes another ledger call
    return sent


def _watchdog_matched(rank: int, timeout_s: float, out: dict, results: dict) -> Any:
    """The receive comes within the timeout: nothing fires."""
    from dflash_ray.train import handoff

    sent = None
    if rank == 0:
        sent = handoff.send({"a": torch.arange(4.0)}, [1])
        time.sleep(2 * timeout_s)  # idle past the timeout, counted from the post
    else:
        time.sleep(timeout_s / 2)
        handoff.receive({"a": ([4], "torch.float32")}, 0, "cpu")
        time.sleep(1.5 * timeout_s)
    return sent


# Each scenario runs on both ranks and returns the send it posted (or None), kept alive here until the
# final barrier: a send dropped before its receive is taken is no longer the ledger's to watch.
SCENARIOS: dict[str, Callable[[int, float, dict, dict], Any]] = {
    "no_greeting": _no_greeting,
    "matched": _matched,
    "sync_waits_for_own_send": _sync_waits_for_own_send,
    "watchdog": _watchdog,
    "watchdog_idle": _watchdog_idle,
    "watchdog_matched": _watchdog_matched,
}


def _rank(rank: int, port: int, results: dict, scenario: str, timeout_s: float) -> None:
    from dflash_ray.train import handoff, p2p

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    ledger = p2p.start(rank, "gloo", timeout_s=timeout_s)
    out: dict = {}
    fired: list[tuple[float, str]] = []
    if scenario in RECORDED:
        ledger.on_timeout = lambda message: fired.append((time.monotonic(), message))
    try:
        if scenario != "no_greeting":  # what a run's join does: the pair's communicator opens here
            handoff.greet([1 - rank], rank == 0, "cpu")
        sent = SCENARIOS[scenario](rank, timeout_s, out, results)  # noqa: F841 (kept until received)
        out["ledger_sent"] = dict(ledger.sent)
        dist.barrier()  # every message taken before either process leaves
    finally:
        out["fired"] = [(t - out.get("posted", 0.0), m) for t, m in fired]
        results[rank] = out
        dist.destroy_process_group()


def _run(scenario: str, timeout_s: float = 2.0) -> dict:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.Manager().dict()
    spawn(_rank, (free_port(), results, scenario, timeout_s), 2)
    return dict(results)


@pytest.mark.slow
def test_a_send_is_done_only_once_its_receive_is_posted():
    r = _run("matched")
    assert r[0]["done_before"] is False and r[0]["done_after"] is True, r
    assert r[1]["got"] == [[0.0, 1.0, 2.0, 3.0], [[1.0] * 3] * 2]


@pytest.mark.slow
def test_a_device_sync_waits_for_the_ranks_own_unmatched_send_and_raises_past_the_timeout():
    r = _run("sync_waits_for_own_send")
    assert "unmatched send" in r[0]["error"] and "to rank 1" in r[0]["error"], r[0]
    assert 1.9 < r[0]["waited"] < 10, r[0]
    [(_, message)] = r[0]["fired"]  # the watchdog thread's message names the wait too
    assert "waits in a device synchronization" in message, message


@pytest.mark.slow
def test_a_send_unmatched_past_the_timeout_is_ended_by_the_watchdog_thread_and_at_the_next_call():
    r = _run("watchdog")
    assert "watchdog" in r[0]["error"] and "collective_timeout_s" in r[0]["error"], r[0]
    [(after, message)] = r[0]["fired"]  # while the rank slept, counted from the post
    assert 2.0 <= after < 3.0, r[0]
    assert "the features' 'a' to rank 1 (send #2 to it)" in message and "collective_timeout_s=2" in message, message


@pytest.mark.integration
def test_the_watchdog_ends_a_rank_that_posts_a_send_and_goes_idle(capfd):
    from dflash_ray.train.p2p import WATCHDOG_EXIT_CODE

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.Manager().dict()
    with pytest.raises(mp.ProcessExitedException) as ended:  # the other rank is ended with it
        # spawned here, not forked from the server: the ranks' stderr is this test's, read below
        mp.spawn(_rank, args=(free_port(), results, "watchdog_idle", 1.0), nprocs=2, join=True)
    waited = time.time() - results[0]["posted"]
    assert ended.value.error_index == 0 and ended.value.exit_code == WATCHDOG_EXIT_CODE, ended.value
    assert 1.0 <= waited < 3.0, waited  # the timeout, a tick, the exit seen here
    err = capfd.readouterr().err
    assert "rank 0: the features' 'a' to rank 1 (send #2 to it) has had no matching receive" in err, err
    assert "collective_timeout_s=1" in err and f"exit code {WATCHDOG_EXIT_CODE}" in err, err


@pytest.mark.slow
def test_the_watchdog_leaves_a_send_matched_within_the_timeout_alone():
    r = _run("watchdog_matched", timeout_s=1.0)  # with the watchdog's own action: ends the process
    assert r[0]["ledger_sent"] == {1: 2} and r[0]["fired"] == [], r[0]


@pytest.mark.slow
def test_a_pairs_first_message_waits_for_both_sides():
    r = _run("no_greeting")
    assert "first message to rank 1" in r[0]["error"], r[0]


def test_on_nccl_the_ledger_only_passes_calls_through():
    from dflash_ray.train.p2p import Ledger

    ledger = Ledger(rank=0, timeout_s=1.0, enforce=False)
    ledger.settle()  # nothing to wait for, no store needed
    assert ledger.unmatched([(1, 1)]) == []
