"""`ray job submit --working-dir . -- python jobs/run.py STAGE ARGS`: any `dflash-ray` command as a
Ray job, the same arguments (`python jobs/run.py pipeline --config s3://B/run.yaml --json`).

Under `ray job submit` the script's folder, not the working directory, heads `sys.path`. It is
replaced by the repository root, so `dflash_ray` imports from the submitted tree. The job joins the
cluster through the `RAY_ADDRESS` that Ray sets for it.
"""

import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
sys.path[:] = [str(_here.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _here]

if __name__ == "__main__":
    from dflash_ray.cli import main

    sys.exit(main(sys.argv[1:]))
