"""Where a drafter is written (`export`, `pretrain`): a folder of its own, claimed while it is
written, never one the run reads from, never a user's files of the export's names."""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Iterator

from dflash_ray import storage
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    from dflash_ray.writer import Claim


@contextlib.contextmanager
def exporting(
    out_dir: str, reads: tuple[str, ...] = (), made_from: dict | None = None, replace: bool = False
) -> Iterator[Claim]:
    """Hold `out_dir` for one drafter written there (`writer.output`): refused when it overlaps a
    folder the run `reads`, when it holds a user's files or a drafter no dflash-ray run marked as
    its own, when it holds a drafter made from another source or settings (`made_from`) without
    `replace`, or while another export holds it. A folder the claim made is removed again when the
    export fails. Yields the claim (`.check()` before the summary: it was not taken over meanwhile)."""
    from dflash_ray import writer

    for source in reads:
        if storage.overlaps(source, out_dir):  # the export would overwrite what it reads
            raise DFlashError(
                f"the output {out_dir} and {source} overlap (one is, or is inside, the other): "
                "nothing was exported; choose an output folder outside what the run reads",
                file=out_dir,
            )
    storage.require_folder(out_dir, "nothing was exported")
    check_replaceable(out_dir)
    with writer.output(out_dir, "drafter", made_from=made_from, replace=replace, what="nothing was exported") as held:
        yield held  # one export writes here at a time; another is refused


def check_replaceable(out_dir: str) -> None:
    """An export writes `config.json` and `model.safetensors`: into a folder holding them, only when
    they are an earlier drafter export (a re-export); a user's own files of those names are never
    replaced. Other files in the folder are left alone."""
    from dflash_ray.drafter import families

    config = storage.join(out_dir, "config.json")
    weights = storage.join(out_dir, "model.safetensors")
    if storage.exists(config):
        try:
            families.of_architecture(json.loads(storage.read_text(config)).get("architectures") or [])
            return
        except (ValueError, AttributeError):  # not JSON, not a mapping, or no drafter's architecture
            pass
        raise DFlashError(
            "holds a config.json that is no drafter export: nothing was exported or replaced; choose an empty folder",
            file=config,
        )
    if storage.exists(weights):
        raise DFlashError(
            "holds a model.safetensors without a drafter's config.json: nothing was exported or "
            "replaced; choose an empty folder",
            file=weights,
        )
