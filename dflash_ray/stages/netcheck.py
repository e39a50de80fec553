"""`dflash-ray netcheck`: the all-reduce bus bandwidth the drafters' collectives will get, measured
over probes placed as the training streams are (one per stream, in its drafter's bundle, on
`train.node_resource` nodes), for the whole group and for every node pair (`train/netprobe.py`).

`train.min_bus_bandwidth` (GB/s) is the floor: `dflash-ray train` (and the pipeline's training)
measures first and refuses to start when a node pair is below it, naming the pair, rather than
crawling for hours over a socket fallback. 0 (the default) measures nothing.

`--storage URI` measures instead the rate a training node reads a model folder (local or `s3://`)
at, in the ranged reads a stream's start-up makes, its largest files first: the figure
`plan.storage_gb_per_s` prices the cold start with. A URI with nothing to read is refused on the
driver before Ray starts; the figure is advised only from at least one round of the reads run at
once (fewer bytes time the requests' latency), and always within the range `plan` takes."""

from __future__ import annotations

import argparse
from typing import Any

from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError
from dflash_ray.stages import Stage
from dflash_ray.train.network import MEGABYTES, check_floor, measure


def run_netcheck(cfg: RunConfig, megabytes: float = MEGABYTES, iters: int = 5) -> dict[str, Any]:
    """The measurement on the cluster `cfg.ray` names, with the floor's verdict (not an error here:
    the figures are what this command is for)."""
    import ray

    from dflash_ray.cluster import connect
    from dflash_ray.train.devices import check_resources

    tcfg = cfg.train
    if iters < 1:
        raise DFlashError(f"{iters}: allowed: >= 1 timed all-reduces", field="--iters")
    if not 0.001 <= megabytes <= 1e5:  # a measurement of bytes, not of latency; and finite
        raise DFlashError(f"{megabytes:g}: allowed: from 0.001 (1 KB) to 100000", field="--megabytes")
    if tcfg.num_streams < 2:
        raise DFlashError("one training stream has no collective to measure", field="train.num_streams")
    connect(cfg.ray)
    check_resources(tcfg, [node["Resources"] for node in ray.nodes() if node.get("Alive")])
    summary = measure(tcfg, megabytes, iters)
    floor = tcfg.min_bus_bandwidth
    try:
        check_floor(summary, floor)
        verdict = None
    except DFlashError as e:
        verdict = str(e)
    return {
        **summary,
        "floor_gbs": floor,
        "above_floor": verdict is None if floor > 0 else None,
        "below_floor": verdict,
    }


def storage_files(uri: str) -> dict[str, int]:
    """The files `--storage` names, by size: the file `uri`, or those directly in the folder `uri`
    (a local path or `s3://`), as a start-up lists them (`storage.list_files`). Checked on the driver
    before Ray starts: a URI with nothing to read there is refused naming it."""
    if not uri.strip():
        raise DFlashError("is empty: give a model folder, a local path or s3://BUCKET/PREFIX", field="--storage")
    try:
        sizes = _sizes(uri)
    except DFlashError as e:
        if e.field == "--storage":
            raise
        raise DFlashError(e.message if e.file in (None, uri) else str(e), file=uri, field="--storage") from None
    except OSError as e:
        raise DFlashError(f"cannot be read: {e.strerror or type(e).__name__}", file=uri, field="--storage") from None
    except Exception as e:
        if type(e).__module__.startswith(("botocore", "boto3")):  # S3's refusal the client names no better
            raise DFlashError(f"S3: {e}", file=uri, field="--storage") from None
        raise
    if not sizes:
        raise DFlashError(
            "no file directly in this folder to read (a model's files lie in one folder; sub-folders are not read)",
            file=uri,
            field="--storage",
        )
    if not any(sizes.values()):
        raise DFlashError(f"its {len(sizes)} file(s) are empty: nothing to read", file=uri, field="--storage")
    return sizes


def _sizes(uri: str) -> dict[str, int]:
    """Each file `uri` names, with its size: itself when it is a file, else the files directly in it."""
    from dflash_ray import s3, storage
    from dflash_ray.registry import HUB_ID

    if storage.is_s3(uri):
        _, key = s3.split(uri)
        found = [uri] if key and not key.endswith("/") and storage.exists(uri) else storage.list_files(uri)
    else:
        path = storage.local_path(uri)
        if not path.exists():
            if HUB_ID.match(uri):
                raise DFlashError(
                    "a Hugging Face Hub id, or no such path: --storage measures local or s3:// storage, whose "
                    "ranged reads a stream's start-up makes; give the folder the model lies in",
                    file=uri,
                    field="--storage",
                )
            raise DFlashError("no such file or folder here", file=uri, field="--storage")
        found = [uri] if path.is_file() else storage.list_files(uri)
    return {f: storage.size(f) for f in found}


def read_rate(files: dict[str, int], max_bytes: int) -> dict[str, Any]:
    """The rate ranged reads give on this node: the largest of `files` first, from their start, up to
    `max_bytes` in all, cut into chunks of which as many are read at once as a stream's start-up
    reads (`model_fetch.settings`, over all the files as `fetch_folder` does), into memory."""
    import concurrent.futures
    import time

    from dflash_ray import model_fetch, storage

    concurrency, chunk = model_fetch.settings()
    ranges, left = [], max_bytes
    for f in sorted(files, key=lambda f: (-files[f], f)):
        n = min(files[f], left)
        ranges += [(f, at, min(n, at + chunk)) for at in range(0, n, chunk)]
        left -= n
        if left <= 0:
            break

    def one(r: tuple[str, int, int]) -> int:
        try:
            return len(storage.read_range(*r))
        except OSError as e:  # there on the driver, not on this node
            raise DFlashError(
                f"cannot be read on a training node: {e.strerror}", file=r[0], field="--storage"
            ) from None

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="storage") as pool:
        read = sum(pool.map(one, ranges))
    return {
        "files": list(dict.fromkeys(f for f, _, _ in ranges)),
        "bytes": read,
        "seconds": time.perf_counter() - started,
        "concurrency": concurrency,
        "chunk_bytes": chunk,
    }


def advice(measured: dict[str, Any]) -> dict[str, Any]:
    """The measured rate and the `plan.storage_gb_per_s` it advises: always a value `plan` takes
    (clamped into the field's range, and said so); none from fewer bytes than one round of the reads
    run at once, whose time is the requests' latency, not the storage's rate."""
    import math

    from dflash_ray.settings.plan import GB_PER_S

    n, seconds = measured["bytes"], measured["seconds"]
    rate = n / 1e9 / seconds if seconds > 0 else math.inf
    out: dict[str, Any] = {
        "seconds": round(seconds, 3),
        "storage_gb_per_s": float(f"{rate:.4g}") if math.isfinite(rate) else None,
        "set": None,
    }
    one_round = measured["concurrency"] * measured["chunk_bytes"]
    if n < one_round:
        out["warning"] = (
            f"{n} bytes read: fewer than one round of the ranged reads a start-up runs at once "
            f"({measured['concurrency']} of {measured['chunk_bytes'] / (1 << 20):g} MiB, {one_round} bytes), so the "
            "time is the requests' latency more than the storage's rate and advises no plan.storage_gb_per_s; "
            "measure a folder with a larger file (a model's shards), or more --megabytes"
        )
        return out
    low, high = GB_PER_S
    value = min(max(rate, low), high)
    out["set"] = f"--set plan.storage_gb_per_s={value:.4g}"
    if value != rate:
        out["warning"] = (
            f"{rate:.4g} GB/s is outside the range plan.storage_gb_per_s takes ([{low:g}, {high:g}]): advised at "
            f"its {'floor' if value == low else 'ceiling'}"
        )
    return out


def run_storage_check(cfg: RunConfig, uri: str, megabytes: float) -> dict[str, Any]:
    """The rate a training node reads `uri` (a model folder or file) at, in the ranged reads a
    stream's start-up makes (`model_fetch`): `plan.storage_gb_per_s`'s figure."""
    import ray

    from dflash_ray.cluster import connect, on_node

    if not 1 <= megabytes <= 1e6:
        raise DFlashError(f"{megabytes:g}: allowed: from 1 to 1000000 MB read", field="--megabytes")
    files = storage_files(uri)
    connect(cfg.ray)
    task = ray.remote(read_rate).options(num_cpus=0, resources=on_node(cfg.train.node_resource))
    measured = ray.get(task.remote(files, int(megabytes * 1e6)))
    return {
        "stage": "netcheck",
        "storage": uri,
        **{k: measured[k] for k in ("files", "bytes", "concurrency")},
        "chunk_mb": round(measured["chunk_bytes"] / (1 << 20), 3),
        **advice(measured),
    }


def _netcheck(args, cfg: RunConfig) -> dict[str, Any]:
    if args.storage is not None:
        return run_storage_check(cfg, args.storage, args.megabytes if args.megabytes != MEGABYTES else 4096)
    return run_netcheck(cfg, megabytes=args.megabytes, iters=args.iters)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megabytes", type=float, default=MEGABYTES, help="all-reduced by each rank (default 64)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces per measurement (default 5)")
    p.add_argument(
        "--storage",
        metavar="URI",
        help="instead, the rate a training node reads this model folder at (ranged reads; the first "
        "--megabytes of its largest files, default 4096): plan.storage_gb_per_s",
    )


STAGES = (
    Stage(
        name="netcheck",
        help="all-reduce bus bandwidth between the training ranks, per node pair (train.min_bus_bandwidth)",
        command=_netcheck,
        arguments=_arguments,
        section="train",
        order=91,
    ),
)
