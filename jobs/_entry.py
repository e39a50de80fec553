"""Shared entry for the `jobs/` scripts: `ray job submit --working-dir . -- python jobs/X.py ...`.

Under `ray job submit` the script's folder, not the working directory, heads `sys.path`. It is
replaced by the repository root, so `dflash_ray` imports and `jobs/tokenize.py` does not shadow the
standard library's `tokenize`; then the arguments go to the CLI. The job joins the cluster through
the `RAY_ADDRESS` that Ray sets for it.
"""

import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
sys.path[:] = [str(_here.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _here]


def run(stage: str) -> None:
    from dflash_ray.cli import main

    sys.exit(main([stage, *sys.argv[1:]]))
