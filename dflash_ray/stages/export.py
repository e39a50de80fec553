"""`dflash-ray export`: a training checkpoint (or a drafter folder), local or on S3, → the serving
format that vLLM and SGLang load (`drafter.export`), written to a local folder or `s3://`.

A training checkpoint's drafter files are first checked against its manifest (size and sha256):
a corrupt or truncated file is an error naming it, never a drafter exported with garbage weights."""

from __future__ import annotations

from typing import Any

from dflash_ray import storage
from dflash_ray.errors import DFlashError


def verify_drafter_files(checkpoint_uri: str) -> int:
    """The number of drafter files checked; 0 for a folder without a checkpoint manifest."""
    from dflash_ray.train import checkpoint as ckpt

    folder = checkpoint_uri.rstrip("/")
    step = ckpt.step_of(folder)
    if step is None or not storage.exists(storage.join(folder, ckpt.MANIFEST)):
        return 0
    output = folder.rsplit("/", 2)[0]  # OUTPUT/checkpoints/step-N
    try:
        manifest = ckpt.read_manifest(output, step)
        names = [n for n in manifest["files"] if n.startswith("drafter/")]
        for name in names:
            ckpt.read_file(output, step, name, manifest)
    except ckpt.CorruptCheckpoint as e:
        earlier = [s for s in ckpt.complete_steps(output) if s < step]
        hint = f"export an earlier checkpoint ({ckpt.step_dir(output, earlier[-1])})" if earlier \
            else "resume the training run to write a new checkpoint"
        raise DFlashError(f"{e}; nothing was exported: {hint}") from None
    return len(names)


def run_export(checkpoint: str, out_dir: str, *, dtype: str = "bfloat16") -> dict[str, Any]:
    from dflash_ray.drafter.export import export_checkpoint

    if storage.overlaps(checkpoint, out_dir):  # the export would overwrite what it reads
        raise DFlashError(f"the output {out_dir} and the checkpoint {checkpoint} overlap (one is, or is inside, "
                          "the other): nothing was exported; choose an output folder outside the checkpoint",
                          file=out_dir)
    if not storage.is_s3(out_dir) and storage.local_path(out_dir).exists() and not storage.local_path(out_dir).is_dir():
        raise DFlashError("is a file, not a folder: nothing was exported; choose a folder", file=out_dir)
    verified = verify_drafter_files(checkpoint)
    return {**export_checkpoint(checkpoint, out_dir, dtype=dtype), "verified_files": verified}
