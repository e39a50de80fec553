"""The settings' reference, written from the dataclasses and their comments so that it cannot drift:
`docs/settings.md` (every key, its default, range and meaning, and the module that defines it) and
the sections' table of `docs/configuration.md`. `python -m dflash_ray.settings.docs` rewrites both;
a test fails when either is stale."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

from dflash_ray.settings.run import RunConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"
BEGIN, END = "<!-- sections: written by python -m dflash_ray.settings.docs -->", "<!-- end of sections -->"
_FIELD = re.compile(r"^\s+(\w+): [^=]+?(?:=.*?)?(?:\s+#\s?(?P<trailing>.*))?$")


def _comments(cls: type) -> dict[str, str]:
    """Each field's comment in `cls`'s own source: the comment lines just above it and the one after it."""
    notes: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD.match(line)
        if match and not stripped.startswith(("def ", "@", '"""')):
            notes[match.group(1)] = " ".join(above + [match.group("trailing") or ""]).strip()
        above = []
    return notes


def _owner(cls: type, name: str) -> type:
    """The class of `cls`'s bases (or itself) whose own annotations declare `name`."""
    return next(base for base in reversed(cls.__mro__) if name in base.__dict__.get("__annotations__", {}))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if not isinstance(f.default, str) else f'"{f.default}"'
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    return "(section)" if dataclasses.is_dataclass(value) else repr(value)


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str, str, str]]:
    """(key, default, allowed, meaning, module) of every field of `cls`, its sections' fields after it."""
    rows, nested = [], []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        owner = _owner(cls, f.name)
        meaning = _comments(owner).get(f.name, "")
        allowed = f.metadata["range"][1] if "range" in f.metadata else ""
        if typing.get_origin(hints[f.name]) is typing.Literal:
            allowed = " / ".join(str(a) for a in typing.get_args(hints[f.name]))
        rows.append((f"{prefix}{f.name}", _default(f), allowed, meaning, owner.__module__))
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((hints[f.name], f"{prefix}{f.name}."))
        elif typing.get_args(hints[f.name]) and dataclasses.is_dataclass(typing.get_args(hints[f.name])[0]):
            nested.append((typing.get_args(hints[f.name])[0], f"{prefix}{f.name}[i]."))
    for inner, inner_prefix in nested:
        rows += _rows(inner, inner_prefix)
    return rows


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(RunConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])]


def reference() -> str:
    """`docs/settings.md`: a table a section."""
    out = [
        "# Settings reference",
        "",
        "Every key a config file or `--set section.key=value` may give, its default, what it allows and",
        "what it does, and the module that defines it (whose docstring names the code that reads it).",
        "Written by `python -m dflash_ray.settings.docs` from the dataclasses; edit those, not this file.",
    ]
    top = [row for row in _rows(RunConfig, "") if row[1] != "(section)" and "." not in row[0]]
    for name, cls in [("(top level)", None), *_sections()]:
        rows = top if cls is None else _rows(cls, f"{name}.")
        out += [
            "",
            f"## `{name}`",
            "",
            "| key | default | allowed | what it does | defined in |",
            "|---|---|---|---|---|",
        ]
        for key, default, allowed, meaning, module in rows:
            cell = [f"`{key}`", f"`{default}`", allowed, meaning, f"`{module}`"]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cell) + " |")
    return "\n".join(out) + "\n"


def sections_table() -> str:
    """The sections' table of `docs/configuration.md`: each section's keys and where they are defined."""
    out = [BEGIN, "| section | keys (each in [settings.md](settings.md)) | defined in |", "|---|---|---|"]
    for name, cls in _sections():
        rows = _rows(cls, "")
        modules = sorted({module for *_, module in rows})
        keys = ", ".join(f"`{key}`" for key, *_ in rows)
        out.append(f"| `{name}` | {keys} | {', '.join(f'`{m}`' for m in modules)} |")
    return "\n".join(out + [END])


def configuration(text: str) -> str:
    """`docs/configuration.md`'s text with its sections' table rewritten."""
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + sections_table() + text[stop:]


def main() -> int:
    (DOCS / "settings.md").write_text(reference())
    path = DOCS / "configuration.md"
    path.write_text(configuration(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
