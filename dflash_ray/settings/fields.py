"""A setting's allowed range and kind, beside it: checked whenever a run config is built, naming the
field (`run.check_section`); a None value (the field's "auto") is not tested. `operational`
marks a setting of how a run executes, not of what it trains: free to differ on resume.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Callable


def _ranged(default: Any, ok: Callable[[Any], bool], allowed: str) -> Any:
    return field(default=default, metadata={"range": (ok, allowed)})


# No setting is unbounded: a count, a size or a time past this is a typo or an overflow, refused
# where the field is declared rather than found when memory or patience runs out (the error says
# so; the docs show the bound only where a field declares a tighter `most` of its own, as one whose
# value sizes a process's memory does).
CEILING = 10**15


def at_least(low: float, *, default: Any, most: float = CEILING) -> Any:
    return _ranged(default, lambda v: low <= v <= most, f">= {low}" if most == CEILING else f">= {low} and <= {most}")


def above(low: float, *, default: Any, most: float = CEILING) -> Any:
    return _ranged(default, lambda v: low < v <= most, f"> {low}" if most == CEILING else f"> {low} and <= {most}")


def operational(spec: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A setting of how a run executes, not of what it trains: free to differ on resume (a plain
    default, a default factory, or a ranged field from the helpers above)."""
    if isinstance(spec, dataclasses.Field):
        return field(
            default=spec.default, default_factory=spec.default_factory, metadata={**spec.metadata, "operational": True}
        )
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={"operational": True})
    return field(default=spec, metadata={"operational": True})


def within(low: float, high: float, *, default: Any, low_open: bool = False, high_open: bool = False) -> Any:
    def ok(v: Any) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return _ranged(default, ok, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")
