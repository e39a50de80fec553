"""Errors the CLI turns into a clear message and an exit code, never a traceback."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator


class DFlashError(Exception):
    """Bad input or configuration: the message names the file, record and field at fault."""

    exit_code = 2

    def __init__(
        self, message: str, *, file: str | None = None, record: int | str | None = None, field: str | None = None
    ):
        where = []
        if file is not None:
            where.append(str(file))
        if record is not None:
            where.append(f"record {record}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(": ".join(where + [message]) if where else message)
        self.message, self.file, self.record, self.field = message, file, record, field
        self.summary: dict = {}

    def with_summary(self, summary: dict) -> "DFlashError":
        """Attach the stage's figures, printed with the error under `--json`."""
        self.summary = summary
        return self


class MissingObject(DFlashError, FileNotFoundError):
    """A file or object that does not exist: a bad input, and still a FileNotFoundError for the
    callers to whom a missing object means "not written yet"."""

    __str__ = Exception.__str__  # the message, not OSError's "[Errno None] ..."


class DiskFull(DFlashError):
    """A write the disk had no room for: the message names the path and the space (`disk.disk_full`).
    Never retried: a restart would meet the same full disk."""


class Interrupted(DFlashError):
    """Ctrl-C: the run stopped cleanly; the message says where it can resume from."""

    exit_code = 130


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Kubernetes, `ray job stop` and `kill` send), raised where Ctrl-C raises
    KeyboardInterrupt, so a long command stops as it does on Ctrl-C: what it committed stays, and it
    says where to go on from; exit 143 (128 + SIGTERM)."""


_sigterm = {"catching": False, "received": False}


def catch_sigterm() -> Any:
    """From now on SIGTERM raises `Terminated` in the main thread; returns the handler it replaced
    (for `release_sigterm`). The CLI calls it first, and the cluster module again after `ray.init`,
    which installs a handler of its own that exits at once."""
    import signal
    import threading

    _sigterm["catching"] = True
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, _terminate)
    return None


def release_sigterm(previous: Any) -> None:
    """Back to the SIGTERM handler before `catch_sigterm`; forget any SIGTERM received."""
    import signal
    import threading

    _sigterm.update(catching=False, received=False)
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def keep_catching_sigterm() -> None:
    """Put the handler of `catch_sigterm` back, if it was installed (after a library replaced it)."""
    if _sigterm["catching"]:
        catch_sigterm()


def _terminate(signum, frame) -> None:
    note_sigterm()
    raise Terminated()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then stop the command as they would have:
    raised inside a library's start-up (`ray.init`'s C++ core starting its threads) they crashed
    the process (exit 139) instead of exiting 130 with its message."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def hold(signum, frame) -> None:
        came.append(signum)

    before = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            if signal.getsignal(s) is hold:  # a handler the block installed (ray's, ours again) stays
                signal.signal(s, handler)
    if signal.SIGTERM in came:
        _terminate(signal.SIGTERM, None)
    if came:
        raise KeyboardInterrupt()


def note_sigterm() -> None:
    """Record that SIGTERM came (a handler that stops its command otherwise than by raising calls it)."""
    _sigterm["received"] = True


def sigterm_received() -> bool:
    return _sigterm["received"]


class GateFailed(DFlashError):
    """The validation gate refused a dataset: the message names each failed rule and its numbers."""

    exit_code = 3


def failure_cause(e: Exception) -> str:
    """One line for an actor's failure: the error it raised (an engine's own, for a start failure),
    or how Ray says it died."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    m = re.match(r"([\w.]*(?:Error|Exception)): (.*)", last)
    if m:  # "builtins.ValueError: ..." -> "ValueError: ..."; our own errors speak for themselves
        kind = m.group(1).rsplit(".", 1)[-1]
        return (m.group(2) if kind == "DFlashError" else f"{kind}: {m.group(2)}")[:1500]
    return f"{type(e).__name__}: {last}"[:1500]


_RAISED = re.compile(r"^dflash_ray\.errors\.(\w+): (.+)$", re.M)


def carried(e: BaseException) -> DFlashError | None:
    """The project's own error that an exception from a Ray worker stands for: the `cause` Ray keeps
    of a task's error, or, where Ray Data keeps only the worker's traceback text, the last
    `dflash_ray.errors.NAME: message` line of it (rebuilt as that class). None when there is none."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, DFlashError):
        return cause
    found = _RAISED.findall(str(e))
    if not found:
        return None
    name, message = found[-1]
    kind = globals().get(name)
    if not (isinstance(kind, type) and issubclass(kind, DFlashError)):
        kind = DFlashError
    return kind(message)
