"""Files on a local disk: written whole or not at all, no more readable than asked, and a full disk named.

`dflash_ray.storage` writes a local path through here. A file is written under a temporary name in
its own folder, flushed to the disk and renamed into place, so a reader sees the old file or the
whole new one; it is made with the umask's permissions, no wider than the caller's `mode`. A write
the disk (or a quota) has no room for leaves nothing half-written and raises `DiskFull` naming the
path, the bytes it needed and what is free there; `no_space` tells such a failure from any library
that writes files itself (safetensors, a tokenizer's save), so their callers name it the same way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dflash_ray.errors import DiskFull


def no_space(error: BaseException) -> bool:
    """Whether `error` is a full disk (or quota): errno ENOSPC or EDQUOT, or a library's own words
    for it (safetensors and others pass the OS's message on without its number)."""
    import errno

    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    said = str(error)
    return "No space left on device" in said or "Disk quota exceeded" in said


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"


def disk_full(path: str | Path, needed: int | None = None) -> DiskFull:
    """The error of a write the disk had no room for: the path, the bytes the write needed (when
    known) and what is free there. The caller has removed what it left half-written."""
    where = Path(str(path).removeprefix("file://"))
    free = None
    for folder in (where, *where.parents):
        try:
            free = shutil.disk_usage(folder).free
            break
        except OSError:
            continue
    wanted = f"{human_bytes(needed)} to write, " if needed is not None else ""
    room = f"{human_bytes(free)} free there" if free is not None else "the free space is unknown"
    return DiskFull(
        f"no space left on the device ({wanted}{room}): nothing half-written is left; free space "
        "there, or write to a folder on another disk",
        file=str(path),
    )


def write_atomic(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write `data` to `path` under a temporary name, then rename it into place; the file gets the
    umask's permissions, no wider than `mode`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        if no_space(e):
            raise disk_full(path, len(data)) from None
        raise
    try:
        os.fchmod(fd, 0o666 & ~_umask() & mode)  # as `open` would make it: mkstemp's own is 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if no_space(e):
            raise disk_full(path, len(data)) from None
        raise


def _umask() -> int:
    """The process's umask, read without changing it (other threads may be creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)  # no /proc: read it the only other way, and put it back at once
    os.umask(current)
    return current


def copy_atomic(src: str | Path, dst: Path) -> None:
    """Copy the file `src` to `dst` under a temporary name, then rename it into place (for files too
    large to hold in memory)."""
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.tmp"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if no_space(e):
            raise disk_full(dst, Path(src).stat().st_size) from None
        raise
