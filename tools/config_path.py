"""The path a run's settings take through the package, from `dflash-ray train` to the moment it would
start the cluster: every call of the package's code that receives the config (or one of its
sections, or the run resolved from it: `train.resolved`) as an argument, in order, grouped by
module. It says how many modules the settings enter, how often the path climbs to a higher floor
(`tests/test_layering.py`'s FLOORS), and how often it goes back to a module it had left: the
measure of how scattered a run's resolution is.

    .venv/bin/python tools/config_path.py [--json] [--path]

It trains nothing: a tiny target and dataset are written to a temporary folder, and the call that
would start the coordinator is stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


class _Stop(Exception):
    """Raised where the stage would start the coordinator: the path is complete."""


# what carries a run's settings: the config and its sections, and the run resolved from them
# (`train.resolved`: the placement, each drafter's settings, shape and start), which the stage and the
# coordinator receive in their place
SETTINGS_MODULES = ("dflash_ray.config", "dflash_ray.settings", "dflash_ray.train.resolved")


def _is_settings(value) -> bool:
    return type(value).__module__.startswith(SETTINGS_MODULES)


def trace() -> list[str]:
    """The modules, in call order, of the calls that received the settings (consecutive repeats merged)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_ray.config import load_config
    from dflash_ray.stages import train as stage
    from dflash_ray.tiny_models import tiny_qwen3

    work = Path(tempfile.mkdtemp(prefix="config-path-"))
    target = tiny_qwen3(work / "target", num_layers=4, hidden_size=64, vocab_size=512)
    (work / "data").mkdir()
    rows = [{"input_ids": list(range(1, 41)), "loss_mask": [0] * 8 + [1] * 32, "seq_len": 40}] * 8
    pq.write_table(pa.Table.from_pylist(rows), work / "data" / "part-0.parquet")
    cfg = load_config(None, ["train.num_layers=1", "train.num_streams=1", "train.target_layer_ids=[0,1,2]"])

    def stop(*args, **kwargs):
        raise _Stop()

    stage._train = stop
    path: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("dflash_ray") or module.startswith(("dflash_ray.config", "dflash_ray.settings")):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(_is_settings(frame.f_locals.get(n)) for n in names) and (not path or path[-1] != module):
            path.append(module)

    sys.setprofile(profile)
    try:
        stage.run_train(target, str(work / "data"), str(work / "out"), cfg, progress=False)
    except _Stop:
        pass
    finally:
        sys.setprofile(None)
    return path


def measure(path: list[str]) -> dict:
    from test_layering import FLOORS, floor_of

    climbs = [f"{a} -> {b}" for a, b in zip(path, path[1:]) if floor_of(b) > floor_of(a)]
    returns = sum(1 for i, m in enumerate(path) if m in path[: max(0, i - 1)])
    return {
        "modules_entered": len(set(path)),
        "calls_in_order": len(path),
        "climbs": len(climbs),
        "returns": returns,
        "floors": sorted({FLOORS[floor_of(m)][0] for m in path}),
        "climbs_seen": climbs,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="the figures as one JSON line")
    p.add_argument("--path", action="store_true", help="also print the modules in order")
    args = p.parse_args()
    path = trace()
    figures = measure(path)
    if args.json:
        print(json.dumps({**figures, **({"path": path} if args.path else {})}))
        return 0
    print(
        f"{figures['modules_entered']} modules entered, {figures['climbs']} climbs up a floor, "
        f"{figures['returns']} returns to a module left before"
    )
    if args.path:
        print(" -> ".join(m.removeprefix("dflash_ray.") for m in path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
