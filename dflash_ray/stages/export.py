"""`dflash-ray export`: a training checkpoint (or a drafter folder), local or on S3, → the serving
format that vLLM and SGLang load (`drafter.export`), written to a local folder or `s3://`.

A training checkpoint's files are checked against its manifest (size and sha256) as they are read:
a corrupt or truncated file, or a checkpoint without its manifest, is an error naming it, never a
drafter exported with garbage weights."""

from __future__ import annotations

import argparse
from typing import Any

from dflash_ray import storage
from dflash_ray.errors import DFlashError
from dflash_ray.stages import PipelineRun, Stage


def run_export(checkpoint: str, out_dir: str, *, dtype: str = "bfloat16", replace: bool = False) -> dict[str, Any]:
    """A training checkpoint (sharded: assembled here from every rank's shard, each file checked
    against the checkpoint's manifest whatever the folder is called) or a drafter folder → the
    serving format in `out_dir` (a drafter exported there from another source is replaced only
    with `replace`)."""
    from dflash_ray.drafter.export_folder import exporting

    with exporting(
        out_dir, (checkpoint,), made_from={"made_by": "export", "source": checkpoint}, replace=replace
    ) as held:
        summary = _export(checkpoint, out_dir, dtype)
        held.check()
    return summary


def _export(checkpoint: str, out_dir: str, dtype: str) -> dict[str, Any]:
    from dflash_ray.drafter.export import export_checkpoint, export_drafter
    from dflash_ray.train import checkpoint as ckpt
    from dflash_ray.train import checkpoint_files

    steps = ckpt.complete_steps(checkpoint)  # a training run's output given whole: name its newest checkpoint
    if steps and not checkpoint_files.is_sharded(checkpoint):
        raise DFlashError(
            f"a training run's output, not one checkpoint: export one of its {len(steps)} complete checkpoints, "
            f"the newest being {ckpt.step_dir(checkpoint, steps[-1])}",
            file=checkpoint,
        )
    try:
        if not checkpoint_files.is_sharded(
            checkpoint
        ):  # a drafter folder, or a whole-file checkpoint of an earlier version
            verified = _verify_whole_files(checkpoint)
            return {**export_checkpoint(checkpoint, out_dir, dtype=dtype), "verified_files": verified}
        drafter, verified = checkpoint_files.assemble(checkpoint)
    except ckpt.CorruptCheckpoint as e:
        folder = checkpoint.rstrip("/")
        step, output = ckpt.step_of(folder), folder.rsplit("/", 2)[0]  # OUTPUT/checkpoints/step-N
        earlier = [s for s in ckpt.complete_steps(output) if step is not None and s < step]
        hint = (
            f"export an earlier checkpoint ({ckpt.step_dir(output, earlier[-1])})"
            if earlier
            else "resume the training run to write a new checkpoint"
        )
        raise DFlashError(f"{e}; nothing was exported: {hint}") from None
    return {**export_drafter(drafter, out_dir, dtype), "checkpoint": checkpoint, "verified_files": verified}


def _verify_whole_files(folder: str) -> int:
    """The drafter files of a folder with a checkpoint manifest, checked against it (whatever the
    folder is called); 0 for a plain drafter folder."""
    from dflash_ray.train import checkpoint as ckpt

    if not storage.exists(storage.join(folder, ckpt.MANIFEST)):
        return 0
    manifest = ckpt.read_folder_manifest(folder)
    names = [n for n in manifest["files"] if n.startswith("drafter/")]
    for name in names:
        ckpt.read_checked(folder, name, manifest)
    return len(names)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a training checkpoint or drafter folder (path or URI)")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument(
        "--replace", action="store_true", help="replace a drafter this command exported there from another source"
    )


def _step(run: PipelineRun) -> dict[str, Any]:
    """Each trained drafter in the serving format, under `drafter/` (`drafter/NAME` for several);
    fp32, as it is evaluated next."""
    exported = {}
    for name, trained in run.results["train"].items():
        out = run.at(f"drafter/{name}" if name else "drafter")
        run_export(trained["checkpoint"], out, dtype="float32", replace=True)  # the pipeline's own folder
        exported[name] = out
    run.results["export"] = exported
    return {}


STAGES = (
    Stage(
        name="export",
        help="write a drafter in the format vLLM and SGLang load",
        command=lambda args, cfg: run_export(args.checkpoint, args.out_dir, dtype=args.dtype, replace=args.replace),
        arguments=_arguments,
        order=60,
        inputs=("train",),
        outputs=("drafter",),
        step=_step,
    ),
)
