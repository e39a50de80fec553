"""Hugging Face Hub datasets as inputs: `hf://datasets/ORG/NAME[/CONFIG][@REVISION][:SPLIT]`.

The split defaults to `train`, the config to the dataset's default, the revision to `main`. Rows are
read with the `datasets` library, streamed: online from the Hub (nothing is downloaded whole; the
revision is pinned to its commit first), and with `HF_HUB_OFFLINE=1` from the local Hugging Face
cache alone (`hf download ORG/NAME --repo-type dataset` fills it). Each row comes back as a
`RawRecord` whose `file` is the dataset's URI (split included) and `line` its 1-based row, so
quarantine names the dataset and the row.
"""

from __future__ import annotations

from typing import Any, Iterator

from dflash_ray.data.formats import BadRecord
from dflash_ray.data.records import RawRecord, arrow_row
from dflash_ray.errors import DFlashError
from dflash_ray.hub_uri import DEFAULT_SPLIT, PREFIX, SYNTAX, HubDataset, is_hub_dataset, parse  # noqa: F401


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def open_dataset(ds: HubDataset) -> tuple[Any, str | None]:
    """The split as a streaming `IterableDataset`, and the commit it is read at (None when unknown).

    Fails at once, naming the URI and what to do, when the dataset, revision, config or split is not
    there (not cached offline, not on the Hub, gated)."""
    import datasets

    try:
        if _offline():
            from huggingface_hub import snapshot_download

            from dflash_ray.registry import revision_of

            path = snapshot_download(ds.repo_id, repo_type="dataset", revision=ds.revision)
            commit, source, revision = revision_of(path), path, None
        else:
            from huggingface_hub import HfApi

            commit = HfApi().dataset_info(ds.repo_id, revision=ds.revision).sha
            source, revision = ds.repo_id, commit
    except Exception as e:  # not cached offline, no such repo or revision, gated, no network
        if _offline():
            from huggingface_hub import constants

            hint = (
                f"HF_HUB_OFFLINE is set and the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
                f"does not hold it: download it first (`hf download {ds.repo_id} --repo-type dataset"
                f"{f' --revision {ds.revision}' if ds.revision else ''}`) or unset HF_HUB_OFFLINE"
            )
        else:
            hint = "the Hugging Face Hub cannot give it (check the name, the revision, access to a gated set)"
        raise DFlashError(f"{hint}: {type(e).__name__}: {_first_line(e)}", file=ds.uri) from None
    try:
        stream = datasets.load_dataset(source, name=ds.config, split=ds.split, revision=revision, streaming=True)
    except (ValueError, OSError, datasets.exceptions.DatasetsError) as e:
        # a bad split or config: the message lists the available ones
        raise DFlashError(f"cannot open the config/split: {_first_line(e)}", file=ds.uri) from None
    return stream, commit


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def iter_hub_records(ds: HubDataset, stream: Any) -> Iterator[RawRecord]:
    """The rows of an opened split. A row that cannot be decoded (files of the set whose columns
    disagree) ends the read with one entry, as a corrupt file does; a network failure stops the run."""
    import httpx
    import pyarrow as pa

    number = 0
    rows = iter(stream)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:
            if isinstance(e, (OSError, httpx.TransportError)) and not isinstance(e, pa.ArrowException):
                raise DFlashError(
                    f"reading failed after row {number}: {type(e).__name__}: {_first_line(e)}", file=ds.uri
                ) from None
            # a file of the set that is corrupt, or whose columns disagree with the others'
            yield RawRecord(
                ds.uri,
                number + 1,
                error=BadRecord(f"unreadable after row {number}: {type(e).__name__}: {_first_line(e)}", "corrupt_file"),
            )
            return
        number += 1
        yield RawRecord(ds.uri, number, record=arrow_row(row))
