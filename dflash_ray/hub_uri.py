"""The syntax of a Hugging Face Hub dataset URI, `hf://datasets/ORG/NAME[/CONFIG][@REVISION][:SPLIT]`:
read by the settings' checks (below every reader) and by `data/hub.py`, which reads the rows."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_ray.errors import DFlashError

PREFIX = "hf://datasets/"
DEFAULT_SPLIT = "train"
_URI = re.compile(
    r"^hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:/(?P<config>[^/@:]+))?"
    r"(?:@(?P<revision>[^:@]+))?(?::(?P<split>[\w.-]+))?$"
)
SYNTAX = "hf://datasets/ORG/NAME[/CONFIG][@REVISION][:SPLIT]"


def is_hub_dataset(uri: str) -> bool:
    return uri.startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class HubDataset:
    repo_id: str
    config: str | None
    revision: str | None
    split: str

    @property
    def uri(self) -> str:
        """The URI with its split spelled out: what quarantine entries name."""
        return (
            f"{PREFIX}{self.repo_id}"
            + (f"/{self.config}" if self.config else "")
            + (f"@{self.revision}" if self.revision else "")
            + f":{self.split}"
        )

    @property
    def name(self) -> str:
        """The prompt rows' `source`: ORG/NAME[/CONFIG]:SPLIT."""
        return self.repo_id + (f"/{self.config}" if self.config else "") + f":{self.split}"


def parse(uri: str, field: str | None = None) -> HubDataset:
    match = _URI.match(uri)
    if match is None:
        raise DFlashError(f"not a Hugging Face dataset URI; allowed: {SYNTAX}", file=uri, field=field)
    return HubDataset(match["repo"], match["config"], match["revision"], match["split"] or DEFAULT_SPLIT)
