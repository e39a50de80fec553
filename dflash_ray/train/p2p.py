"""Point-to-point sends and receives under NCCL's rules, whatever the backend.

On GPUs a send is a kernel on NCCL's stream that runs until the peer posts the matching receive:
pairs match by order alone (tags are ignored), a pair's first message waits for both sides (that is
when NCCL opens the pair's communicator), and a device synchronization waits for every stream of the
device, a pending send included. So a rank that synchronizes its device while its own send is
unmatched waits for its peer; if the peer waits for that rank, both wait until the watchdog ends
them. Gloo's sends complete into buffers and a CPU synchronization does nothing: a CPU run passes
where the GPU run hangs. Here every send and receive goes through one `Ledger` per process, which on
gloo enforces NCCL's rules itself, using the process group's store: a receiver counts the receives it
posts from each sender, and a send counts as done only once that count reaches it. `settle` (a device
synchronization) waits for every send of the rank to be matched and raises `NcclRuleError` past the
timeout instead of waiting forever.

NCCL's watchdog is a thread of its own whose clock starts when a send is posted, whatever the rank does
next: a target that posts its evaluation sends and goes idle is still aborted once one waits past
`train.collective_timeout_s`. So the ledger runs one too (`Ledger.watch`, started by `start`): every
min(0.2 s, timeout/10) it reads the store (through its own clone of the client) and, for a send
unmatched longer than the timeout, calls `on_timeout`, by default logging why and ending the process
with `WATCHDOG_EXIT_CODE` as NCCL's default error handling does. A send found overdue at the rank's next
call also raises `NcclRuleError` there. The thread stops with `stop`, when `start` makes a new ledger,
or when the process group it was started under is destroyed. On NCCL the ledger only passes the calls
through (NCCL enforces its rules itself). No Ray here.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

# What a rank ended by the watchdog exits with: 128 + SIGABRT, as NCCL's abort reads to a shell.
WATCHDOG_EXIT_CODE = 134


class NcclRuleError(RuntimeError):
    """A rank waited past the timeout for a peer under NCCL's rules: on GPUs, a hang."""


def _key(src: int, dst: int) -> str:
    return f"dflash-p2p/{src}->{dst}"


def end_process(message: str) -> None:
    """What NCCL's watchdog does to a rank whose work timed out: say why, then end the process now."""
    try:
        log.error(message)  # with no handler set up, logging writes it to stderr itself
        if log.hasHandlers():  # which may be files (Ray's): stderr too
            sys.stderr.write(f"{message}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(WATCHDOG_EXIT_CODE)


@dataclass
class _Send:
    dst: int
    ordinal: int  # this send's place among the rank's sends to `dst`, from 1
    posted: float  # time.monotonic() when posted
    what: str
    reported: bool = False  # the watchdog thread has called `on_timeout` for it


@dataclass
class Ledger:
    """The sends and receives of this process's rank (`rank` in the run's process group)."""

    rank: int
    timeout_s: float
    enforce: bool  # emulate NCCL's rules (gloo); False: the backend is NCCL itself
    store: Any = None
    sent: dict[int, int] = field(default_factory=dict)  # peer -> sends posted to it
    received: dict[int, int] = field(default_factory=dict)  # peer -> receives posted from it
    pending: list[_Send] = field(default_factory=list)  # sends not yet known to be matched
    on_timeout: Callable[[str], None] = end_process  # the watchdog thread's action on an overdue send
    waiting_in: str | None = None  # what `settle` is waiting for, while it is
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards `pending`
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def _matched(self, dst: int, store: Any = None) -> int:
        """Receives `dst` has posted from this rank so far (`add` of 0 reads without waiting)."""
        return int((self.store if store is None else store).add(_key(self.rank, dst), 0))

    def _prune(self, store: Any = None) -> None:
        with self._lock:
            dsts = {s.dst for s in self.pending}
        counts = {dst: self._matched(dst, store) for dst in dsts}  # store reads outside the lock
        with self._lock:  # sends posted meanwhile have higher ordinals (or new peers): kept
            self.pending = [s for s in self.pending if s.ordinal > counts.get(s.dst, 0)]

    def _overdue(self, s: _Send, now: float) -> str:
        return (
            f"rank {self.rank}: {s.what} to rank {s.dst} (send #{s.ordinal} to it) has had no "
            f"matching receive for {now - s.posted:.1f} s (train.collective_timeout_s={self.timeout_s:g})"
        )

    def _watchdog(self) -> None:
        """NCCL's watchdog, seen at the rank's next call: a send unmatched longer than the timeout
        ends the rank (raises here; the thread of `watch` ends the process even if no call comes)."""
        if not self.pending:
            return
        self._prune()
        now = time.monotonic()
        with self._lock:
            late = [s for s in self.pending if now - s.posted > self.timeout_s]
        if late:
            raise NcclRuleError(f"{self._overdue(late[0], now)}; NCCL's watchdog would end this rank here")

    def _check(self, store: Any) -> None:
        """One look of the watchdog thread: prune matched sends, act on the oldest overdue one."""
        if not self.pending:
            return
        try:
            self._prune(store)
        except Exception as e:  # the store is gone: matched and unmatched sends look alike, so judge none
            log.debug("rank %d: p2p watchdog could not read the store: %s", self.rank, e)
            return
        now = time.monotonic()
        with self._lock:
            late = [s for s in self.pending if not s.reported and now - s.posted > self.timeout_s]
            for s in late:
                s.reported = True
        if not late:
            return
        message = self._overdue(late[0], now)
        if len(late) > 1:
            message += f" (and {len(late) - 1} more of its sends past the timeout)"
        waiting = self.waiting_in
        if waiting is not None:
            message += (
                f"; meanwhile this rank waits in {waiting} for its own unmatched sends, which on GPUs "
                "waits for NCCL's stream, where each send runs until its peer posts the matching receive"
            )
        message += f". NCCL's watchdog ends the process here (exit code {WATCHDOG_EXIT_CODE})"
        self.on_timeout(message)

    def watch(self) -> None:
        """Start the watchdog thread (enforce mode; once): it checks pending sends against the
        timeout from their posting, whatever this rank does, until `stop` or until the process group
        it started under is destroyed."""
        if not self.enforce or self._thread is not None:
            return
        import torch.distributed as dist

        group = weakref.ref(dist.distributed_c10d._get_default_group())
        clone = getattr(self.store, "clone", None)
        store = clone() if clone is not None else self.store  # a client of its own: no sharing across threads
        interval = max(0.01, min(0.2, self.timeout_s / 10))

        def serving() -> bool:  # the process group this ledger serves is still this process's
            try:
                return dist.is_initialized() and dist.distributed_c10d._get_default_group() is group()
            except Exception:  # destroyed between the two looks
                return False

        def run() -> None:
            while not self._stop.wait(interval):
                if not serving():
                    return
                try:
                    self._check(store)
                except Exception:  # an injected `on_timeout` that raised: keep watching
                    log.exception("rank %d: p2p watchdog", self.rank)

        self._thread = threading.Thread(target=run, name=f"p2p-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the watchdog thread, if it runs."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def send(self, tensor: torch.Tensor, dst: int, what: str) -> Any:
        """Post a non-blocking send of `tensor` to `dst`; returns its work handle."""
        import torch.distributed as dist

        if self.enforce:
            self._watchdog()
        first = dst not in self.sent and dst not in self.received
        work = dist.isend(tensor, dst)
        if self.enforce:
            self.sent[dst] = self.sent.get(dst, 0) + 1
            with self._lock:
                self.pending.append(_Send(dst, self.sent[dst], time.monotonic(), what))
            if first:  # the pair's communicator opens now: both sides wait for each other
                self.settle(f"the first message to rank {dst} (NCCL opens the pair's communicator)", only=dst)
        return work

    def recv(self, tensor: torch.Tensor, src: int) -> Any:
        """Post a non-blocking receive into `tensor` from `src`; returns its work handle."""
        import torch.distributed as dist

        if self.enforce:
            self._watchdog()
            self.received[src] = self.received.get(src, 0) + 1
            self.store.add(_key(src, self.rank), 1)
        return dist.irecv(tensor, src)

    def unmatched(self, sends: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Which of the given (peer, ordinal) sends have no matching receive yet."""
        if not self.enforce or not sends:
            return []
        self._prune()
        with self._lock:
            waiting = {(s.dst, s.ordinal) for s in self.pending}
        return [s for s in sends if s in waiting]

    def last(self, dst: int) -> int:
        """The ordinal of the newest send posted to `dst`."""
        return self.sent.get(dst, 0)

    def settle(self, why: str = "a device synchronization", only: int | None = None) -> None:
        """Wait until every send of this rank (to `only`, if given) is matched, as a device
        synchronization does on GPUs; raise `NcclRuleError` past the timeout."""
        if not self.enforce:
            return
        start = time.monotonic()
        delay = 0.001
        self.waiting_in = why
        try:
            while True:
                self._prune()
                with self._lock:
                    waiting = [s for s in self.pending if only is None or s.dst == only]
                if not waiting:
                    return
                if time.monotonic() - start > self.timeout_s:
                    listed = ", ".join(f"{s.what} to rank {s.dst} (#{s.ordinal})" for s in waiting)
                    raise NcclRuleError(
                        f"rank {self.rank}: {why} waited {self.timeout_s:g} s (train.collective_timeout_s) "
                        f"for its own unmatched send(s): {listed}. On GPUs this is a hang: a device "
                        "synchronization waits for NCCL's stream, where each send runs until its peer "
                        "posts the matching receive"
                    )
                time.sleep(delay)  # the store has no wait-for-value: a short, growing pause between reads
                delay = min(delay * 2, 0.05)
        finally:
            self.waiting_in = None


_ledger: Ledger | None = None


@atexit.register
def _stop_at_exit() -> None:
    if _ledger is not None:
        _ledger.stop()


def start(rank: int, backend: str, timeout_s: float) -> Ledger:
    """This process's ledger, once it has joined the run's process group as `rank` (replacing any
    earlier one); on gloo its watchdog thread runs from here."""
    import torch.distributed as dist

    global _ledger
    if _ledger is not None:
        _ledger.stop()
    enforce = backend != "nccl"
    store = dist.distributed_c10d._get_default_store() if enforce else None
    _ledger = Ledger(rank, timeout_s, enforce, store)
    _ledger.watch()
    return _ledger


def ledger() -> Ledger | None:
    """This process's ledger; None before it joined a run's process group."""
    return _ledger


def settle(why: str = "a device synchronization") -> None:
    """Wait for this process's sends to be matched, if it has any (see `Ledger.settle`)."""
    if _ledger is not None:
        _ledger.settle(why)
