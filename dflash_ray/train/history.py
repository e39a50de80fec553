"""A run's metric rows, appended: each checkpoint commit writes the rows since the last one as a
segment of its own (`metrics/STEP.jsonl`), and `metrics.jsonl` is written whole once, when the run
ends. Carrying every row in each checkpoint's state and rewriting the whole file at each commit
made both quadratic in the run's length (hundreds of MB a commit by the end of a long run), written
while the targets' sends waited. A restart from step k drops the segments past k: those steps are
taken again. No Ray here.
"""

from __future__ import annotations

import json
from typing import Any

from dflash_ray import storage

FOLDER = "metrics"
WHOLE = "metrics.jsonl"


def _segments(output: str) -> list[tuple[int, str]]:
    """(last step, URI) of each segment, in step order."""
    found = []
    for uri in storage.list_files(storage.join(output, FOLDER), ".jsonl"):
        stem = storage.basename(uri).removesuffix(".jsonl")
        if stem.isdigit():
            found.append((int(stem), uri))
    return sorted(found)


def append(output: str, rows: list[dict[str, Any]], step: int) -> None:
    """The rows of the steps since the last segment, as the segment ending at `step`."""
    if rows:
        text = "".join(json.dumps(r) + "\n" for r in rows)
        storage.write_text(storage.join(output, FOLDER, f"{step:09d}.jsonl"), text)


def read(output: str, upto: int) -> list[dict[str, Any]]:
    """The rows of steps 1..`upto`, one per step (a step taken again after a restart: its last row)."""
    by_step: dict[int, dict[str, Any]] = {}
    for _, uri in _segments(output):
        for line in storage.read_text(uri).splitlines():
            if line.strip():
                row = json.loads(line)
                if row["step"] <= upto:
                    by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def drop_after(output: str, step: int) -> None:
    """Forget the segments past `step`: a restart from there takes those steps again."""
    for last, uri in _segments(output):
        if last > step:
            storage.delete(uri)


def write_whole(output: str, rows: list[dict[str, Any]]) -> None:
    """`metrics.jsonl`: every row of the run, once, at its end."""
    storage.write_text(storage.join(output, WHOLE), "".join(json.dumps(r) + "\n" for r in rows))
