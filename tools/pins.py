"""Package pins read from pyproject.toml, the one place they are written, for the installs that
cannot go through `pip install .[extra]` alone (the Makefile, the Dockerfile).

    python tools/pins.py extra cpu torch   # the `torch` requirement of the `cpu` extra
    python tools/pins.py no-deps           # [tool.dflash-ray] no-deps: installed with --no-deps
    python tools/pins.py tool peers        # any list of [tool.dflash-ray], here bench.peers' own
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pins(*args: str) -> list[str]:
    data = tomllib.loads(PYPROJECT.read_text())
    if args[:1] == ("no-deps",):
        return list(data["tool"]["dflash-ray"]["no-deps"])
    if args[:1] == ("tool",) and len(args) == 2:
        found = data["tool"]["dflash-ray"].get(args[1])
        if not isinstance(found, list):
            raise SystemExit(f"{PYPROJECT}: [tool.dflash-ray] has no list {args[1]!r}")
        return list(found)
    if args[:1] == ("extra",) and len(args) == 3:
        _, extra, name = args
        found = [
            r
            for r in data["project"]["optional-dependencies"][extra]
            if re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] == name
        ]
        if len(found) != 1:
            raise SystemExit(f"{PYPROJECT}: the {extra!r} extra has no single pin of {name!r}")
        return found
    raise SystemExit(__doc__)


if __name__ == "__main__":
    print(" ".join(pins(*sys.argv[1:])))
