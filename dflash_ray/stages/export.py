"""`dflash-ray export`: a training checkpoint (or a drafter folder), local or on S3, → the serving
format that vLLM and SGLang load (`drafter.export`), written to a local folder or `s3://`."""

from __future__ import annotations

from typing import Any


def run_export(checkpoint: str, out_dir: str, *, dtype: str = "bfloat16") -> dict[str, Any]:
    from dflash_ray.drafter.export import export_checkpoint

    return export_checkpoint(checkpoint, out_dir, dtype=dtype)
