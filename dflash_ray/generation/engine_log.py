"""An engine's own error, from the log of its processes.

vLLM reports why an engine failed to start only in the log of its own processes, which inherit this
process's stdout and stderr; `EngineLog` copies those on to where they went before and keeps the
last lines, so the error raised can name the cause (`engine_error`) instead of a wrapper's words.
"""

from __future__ import annotations

import collections
import os
import re
import threading

_ERROR_LINE = re.compile(r"(?:^|\] )([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
_POINTERS = ("root cause", "Worker failed with error", "initialization failed")  # wrappers that point elsewhere


def engine_error(lines: list[str]) -> str | None:
    """The first exception line in an engine's log that is its own error, not a wrapper pointing to it."""
    for line in lines:
        m = _ERROR_LINE.search(line.strip())
        if m and not any(p in m.group(2) for p in _POINTERS):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2).strip()}"[:1000]
    return None


class EngineLog:
    """Copies this process's stdout and stderr (fds 1 and 2, which the engine's processes inherit;
    vLLM logs to stdout) to where they went before, keeping the last lines. One per process,
    installed by the first engine that starts."""

    _installed: EngineLog | None = None
    MARK = "dflash-ray: the engine failed to start; its own error is above"

    def __init__(self) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=2000)
        self.count = 0
        self.lock = threading.Lock()
        self.pipes: dict[int, int] = {}  # fd -> inode of the pipe that replaced it
        self.marked = {fd: threading.Event() for fd in (1, 2)}
        for fd in (1, 2):
            read, write = os.pipe()
            self.pipes[fd] = os.fstat(write).st_ino
            out = os.dup(fd)
            os.dup2(write, fd)
            os.close(write)
            threading.Thread(target=self._copy, args=(fd, read, out), daemon=True, name=f"engine-log-{fd}").start()

    @classmethod
    def install(cls) -> EngineLog:
        log = cls._installed
        if log is None or any(os.fstat(fd).st_ino != ino for fd, ino in log.pipes.items()):  # replaced since
            log = cls._installed = cls()
        return log

    def _copy(self, fd: int, read: int, out: int) -> None:
        partial = b""
        while data := os.read(read, 1 << 16):
            try:
                os.write(out, data)
            except OSError:  # the log file went away: keep draining, or writers would block
                pass
            *done, partial = (partial + data).split(b"\n")
            with self.lock:
                for raw in done:
                    line = raw.decode(errors="replace")
                    if line == self.MARK:
                        self.marked[fd].set()
                    self.lines.append(line)
                    self.count += 1

    def mark(self) -> int:
        with self.lock:
            return self.count

    def since(self, mark: int) -> list[str]:
        """The lines written after `mark`, once everything written so far has been read."""
        for fd, event in self.marked.items():
            event.clear()
            os.write(fd, (self.MARK + "\n").encode())
        for event in self.marked.values():
            event.wait(timeout=5)
        with self.lock:
            return list(self.lines)[max(0, len(self.lines) - (self.count - mark)) :]
