"""Sharded training checkpoints: each drafter rank writes and reads its own piece
(`torch.distributed.checkpoint`, the format FSDP2 and torchtitan users know).

A checkpoint folder holds `shards/` (one `__R_0.distcp` file per rank of the drafter that wrote it,
holding that rank's shard of the fp32 weights and of both AdamW moments, and DCP's `.metadata`),
`drafter/config.json` (the serving config), `state.json` and `MANIFEST.json` (`checkpoint`).

Saving: the step that takes a checkpoint copies its shard to host memory (DCP's stager) and goes on;
a background thread plans the save with the other ranks over a gloo group of their own (never the
group training's collectives run on, nor NCCL's), writes the shard to local scratch, then copies it
to the checkpoint folder (`file://` or `s3://`) and hashes it. The coordinator commits the manifest
once every rank's files are there: a writer killed before then leaves no manifest, and the previous
checkpoint stays the newest valid one.

Loading reshards to any number of ranks (DCP's planner reads the pieces each rank's shards need) and
reads only the files those pieces lie in, each checked against the manifest (size and sha256)
before DCP opens it. `assemble` builds the whole drafter offline, without a process group, for export.
No Ray here.

A checkpoint from elsewhere is data, never code: the manifest is a checksum, not a signature, so DCP's
`.metadata` (a pickle) is read by an unpickler that admits only DCP's metadata types, and the
non-tensor values in the shards (the optimizer's settings) are unpickled with `weights_only=True`.
Anything else is refused unloaded, as a `checkpoint.CorruptCheckpoint` naming the file.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from dflash_ray import storage
from dflash_ray.train import checkpoint

if TYPE_CHECKING:
    from dflash_ray.drafter.model import DFlashDrafter

SHARDS = "shards"


def _state(drafter: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    """DCP's state of the drafter (and its optimizer), keyed by parameter name: the same names
    whatever the number of ranks, so a checkpoint loads on any."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if opt is None:
        return {"model": drafter.state_dict()}
    model, optim = get_state_dict(drafter, opt)
    return {"model": model, "optim": optim}


def _write_shard(future, scratch: str, folder: str, extra: dict[str, bytes]) -> dict[str, dict]:
    """Once DCP has written this rank's files to `scratch` (rank 0: and the metadata), copy them and
    `extra` into the checkpoint `folder`; their manifest entries."""
    try:
        future.result()
        entries = {
            f"{SHARDS}/{path.name}": checkpoint.copy_in(path, folder, f"{SHARDS}/{path.name}")
            for path in sorted(Path(scratch).iterdir())
        }
        for name, data in extra.items():
            storage.write_bytes(storage.join(folder, name), data)
            entries[name] = checkpoint.file_entry(data)
        return entries
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def save(
    drafter: nn.Module, opt: torch.optim.Optimizer, folder: str, group, extra: dict[str, bytes]
) -> checkpoint.Upload:
    """Start writing this rank's shard of the drafter and optimizer into checkpoint `folder`; returns
    once the shard is copied to host memory. Collective over `group` (a gloo group of the drafter's
    ranks; None: a lone process with no process group)."""
    import torch.distributed.checkpoint as dcp

    scratch = tempfile.mkdtemp(prefix="dflash-shard-")
    writer = dcp.FileSystemWriter(scratch, thread_count=1, sync_files=False)
    future = dcp.async_save(_state(drafter, opt), storage_writer=writer, process_group=group, no_dist=group is None)
    return checkpoint.Upload(lambda: _write_shard(future, scratch, folder, extra), "checkpoint-shard-upload")


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What DCP's `.metadata` pickle may name (the globals a saved checkpoint's metadata references,
    listed with `pickletools`): DCP's metadata classes, and the torch values they hold."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
    allowed: dict[tuple[str, str], Any] = {(metadata.__name__, n): getattr(metadata, n) for n in names}
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a layout by its name
    allowed[("torch", "Size")] = torch.Size
    allowed |= {("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    for module in ("pathlib", "pathlib._local"):  # the checkpoint id DCP records (Python 3.13 moved the class)
        allowed[(module, "PosixPath")] = allowed[(module, "PurePosixPath")] = pathlib.PurePosixPath
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: a pickle that names any other global (a function
    to call, a class to build) is refused before anything it names is imported or run."""

    def __init__(self, data: bytes, uri: str):
        super().__init__(io.BytesIO(data))
        self.uri, self.allowed = uri, _metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise checkpoint.CorruptCheckpoint(
                f"{self.uri}: refused unread: it names {module}.{name}, which is no part of DCP's "
                "checkpoint metadata (a crafted file would run code when loaded); use a checkpoint "
                "this project wrote"
            )
        return self.allowed[(module, name)]


def read_metadata(data: bytes, uri: str) -> Metadata:
    """DCP's metadata from the bytes of a `.metadata` file at `uri`, unpickled with DCP's types only;
    `checkpoint.CorruptCheckpoint` naming the file for anything else."""
    try:
        found = _MetadataUnpickler(data, uri).load()
    except checkpoint.CorruptCheckpoint:
        raise
    except Exception as e:  # a cut or garbled pickle, or DCP types given arguments they refuse
        raise checkpoint.CorruptCheckpoint(f"{uri}: not DCP's checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(found, Metadata):
        raise checkpoint.CorruptCheckpoint(f"{uri}: holds a {type(found).__name__}, not DCP's checkpoint metadata")
    return found


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a checkpoint's non-tensor values (the optimizer's settings)
    are unpickled with `weights_only=True` (DCP's own planner unpickles them with anything allowed)."""

    def __init__(self, reader: CheckedReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            name = self.reader.storage_data[read_item.storage_index].relative_path
            raise checkpoint.CorruptCheckpoint(
                f"{storage.join(self.reader.folder, SHARDS, name)}: refused: its value "
                f"{read_item.dest_index.fqn} is no plain data ({str(e).splitlines()[0]})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class CheckedReader(FileSystemReader):
    """DCP's file reader over a checkpoint folder on `file://` or `s3://`: a file is checked against
    the manifest (and fetched into `scratch` from S3) before DCP reads it, and only the files that
    hold pieces this rank loads are touched. The metadata is read here, with DCP's types only
    (`read_metadata`), so that a refusal is raised as itself, not as DCP's "metadata not found"."""

    def __init__(self, folder: str, manifest: dict, scratch: str):
        self.folder, self.manifest, self.scratch = folder, manifest, Path(scratch)
        self.remote = storage.is_s3(folder)
        self.checked: set[str] = set()
        super().__init__(self.scratch if self.remote else storage.local_path(storage.join(folder, SHARDS)))
        self.fetch(".metadata")
        uri = storage.join(folder, SHARDS, ".metadata")
        self.metadata = read_metadata((Path(self.path) / ".metadata").read_bytes(), uri)
        for info in self.metadata.storage_data.values():  # the shard files DCP will open
            name = getattr(info, "relative_path", None)
            reason = storage.escapes(storage.join(folder, SHARDS), name)
            if reason is not None:
                raise checkpoint.CorruptCheckpoint(f"{uri}: names {name!r}, which {reason}: nothing was read")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self.metadata, "storage_meta", None) is None:  # as DCP's own reader does
            from torch.distributed.checkpoint.metadata import StorageMeta

            self.metadata.storage_meta = StorageMeta()
        assert self.metadata.storage_meta is not None
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def fetch(self, name: str) -> None:
        if name not in self.checked:
            checkpoint.check_out(
                self.folder, f"{SHARDS}/{name}", self.manifest, self.scratch / name if self.remote else None
            )
            self.checked.add(name)

    def read_data(self, plan, planner):
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self.fetch(name)
        return super().read_data(plan, planner)


def _corrupt_cause(error: BaseException) -> checkpoint.CorruptCheckpoint | None:
    """The `CorruptCheckpoint` behind DCP's error (it wraps each rank's failure), if there is one."""
    if isinstance(error, checkpoint.CorruptCheckpoint):
        return error
    failures = getattr(error, "failures", None) or {}
    for failure in failures.values():
        found = _corrupt_cause(failure[0] if isinstance(failure, tuple) else failure)
        if found is not None:
            return found
    cause = error.__cause__ or error.__context__
    return _corrupt_cause(cause) if cause is not None else None


def _load(state: dict[str, Any], folder: str, manifest: dict, group, no_dist: bool) -> int:
    """Load `state` in place from the checkpoint in `folder`; returns the number of files checked."""
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory(prefix="dflash-shard-") as scratch:
        try:
            reader = CheckedReader(folder, manifest, scratch)
            planner = _WeightsOnlyPlanner(reader)
            dcp.load(state, storage_reader=reader, planner=planner, process_group=group, no_dist=no_dist)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            corrupt = _corrupt_cause(e)
            if corrupt is not None:
                raise corrupt from None
            raise
    return len(reader.checked)


def load(drafter: nn.Module, opt: torch.optim.Optimizer, folder: str, manifest: dict, group) -> None:
    """Load the checkpoint in `folder` into this rank's shards of the drafter and optimizer, whatever
    the number of ranks that wrote it (collective over `group`, as `save`).
    `checkpoint.CorruptCheckpoint` when a file it needs differs from the manifest."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not is_sharded(folder, manifest):
        raise checkpoint.CorruptCheckpoint(
            f"{folder}: a whole-file checkpoint of an earlier version (no {SHARDS}/): "
            "export it with that version, or train into another --output"
        )
    state = _state(drafter, opt)
    _load(state, folder, manifest, group, no_dist=group is None)
    set_state_dict(drafter, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def is_sharded(folder: str, manifest: dict | None = None) -> bool:
    """Whether `folder` is a checkpoint in this format."""
    if manifest is not None:
        return f"{SHARDS}/.metadata" in manifest.get("files", {})
    return storage.exists(storage.join(folder, SHARDS, ".metadata"))


def assemble(folder: str) -> tuple[DFlashDrafter, int]:
    """The whole drafter of a sharded checkpoint folder (any name: a copied or renamed checkpoint is
    checked as well), built from its config and every rank's shard of the weights, without a process
    group (the optimizer state is not read); and the number of files checked against the manifest."""
    from dflash_ray.drafter import families
    from dflash_ray.drafter.export import CONFIG, read_config

    manifest = checkpoint.read_folder_manifest(folder)
    name = f"drafter/{CONFIG}"
    cfg = read_config(checkpoint.read_checked(folder, name, manifest), storage.join(folder, name))
    drafter = families.get(cfg.family).build(cfg).float()
    state = _state(drafter, None)
    with warnings.catch_warnings():  # DCP warns that a load without a process group is one process's: it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checked = _load(state, folder, manifest, None, no_dist=True)
    drafter.load_state_dict(state["model"])
    return drafter, 1 + checked
