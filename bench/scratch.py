"""A benchmark's scratch folder, removed when the process that made it ends: a bench's runs write
data, checkpoints and drafters (hundreds of MB for `bench.drafters`), and a folder left behind by
every run fills the machine's temporary space."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile


def scratch(prefix: str) -> str:
    """A new folder under the temporary directory, named `prefix...`, removed at this process's exit
    (a bench run in a test's process keeps it until the session ends, as its figures are read)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(functools.partial(shutil.rmtree, path, ignore_errors=True))
    return path
