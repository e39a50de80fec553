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
timeout instead of waiting forever; a send posted longer ago than the timeout and still unmatched
raises at the rank's next call, as NCCL's watchdog would end it. On NCCL the ledger only passes the
calls through (NCCL enforces its rules itself). No Ray here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


class NcclRuleError(RuntimeError):
    """A rank waited past the timeout for a peer under NCCL's rules: on GPUs, a hang."""


def _key(src: int, dst: int) -> str:
    return f"dflash-p2p/{src}->{dst}"


@dataclass
class _Send:
    dst: int
    ordinal: int  # this send's place among the rank's sends to `dst`, from 1
    posted: float  # time.monotonic() when posted
    what: str


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

    def _matched(self, dst: int) -> int:
        """Receives `dst` has posted from this rank so far (`add` of 0 reads without waiting)."""
        return int(self.store.add(_key(self.rank, dst), 0))

    def _prune(self) -> None:
        counts: dict[int, int] = {}
        for s in self.pending:
            if s.dst not in counts:
                counts[s.dst] = self._matched(s.dst)
        self.pending = [s for s in self.pending if s.ordinal > counts[s.dst]]

    def _watchdog(self) -> None:
        """NCCL's watchdog: a send unmatched longer than the timeout ends the rank."""
        if not self.pending:
            return
        self._prune()
        now = time.monotonic()
        for s in self.pending:
            if now - s.posted > self.timeout_s:
                raise NcclRuleError(
                    f"rank {self.rank}: {s.what} to rank {s.dst} (send #{s.ordinal} to it) has had no "
                    f"matching receive for {now - s.posted:.0f} s (train.collective_timeout_s="
                    f"{self.timeout_s:g}); NCCL's watchdog would end this rank here"
                )

    def send(self, tensor: torch.Tensor, dst: int, what: str) -> Any:
        """Post a non-blocking send of `tensor` to `dst`; returns its work handle."""
        import torch.distributed as dist

        if self.enforce:
            self._watchdog()
        first = dst not in self.sent and dst not in self.received
        work = dist.isend(tensor, dst)
        if self.enforce:
            self.sent[dst] = self.sent.get(dst, 0) + 1
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
        while True:
            self._prune()
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


_ledger: Ledger | None = None


def start(rank: int, backend: str, timeout_s: float) -> Ledger:
    """This process's ledger, once it has joined the run's process group as `rank`."""
    import torch.distributed as dist

    global _ledger
    enforce = backend != "nccl"
    store = dist.distributed_c10d._get_default_store() if enforce else None
    _ledger = Ledger(rank, timeout_s, enforce, store)
    return _ledger


def ledger() -> Ledger | None:
    """This process's ledger; None before it joined a run's process group."""
    return _ledger


def settle(why: str = "a device synchronization") -> None:
    """Wait for this process's sends to be matched, if it has any (see `Ledger.settle`)."""
    if _ledger is not None:
        _ledger.settle(why)
