"""A run's settings read from a YAML file (a `base:` file first) and dotted `--set a.b=c` overrides,
built into the typed `RunConfig`: unknown keys and wrong types fail before anything runs, naming the
dotted field (and the --set or file that gave it)."""

from __future__ import annotations

import os
import stat
from typing import Any, Callable

import yaml

from dflash_ray.errors import DFlashError
from dflash_ray.settings.coerce import build
from dflash_ray.settings.run import RunConfig


# A config is a page of settings: a file past this size, a value that expands (anchors repeated in
# aliases) past this many values, or one nested deeper than this, is a mistake or an attack, never a
# run's settings. Each is refused as it is read: whatever walks the settings later (the checks, the
# JSON saved with every output) would run out of memory, time or Python's recursion on it.
MAX_CONFIG_BYTES = 16 << 20
MAX_VALUES = 1_000_000
MAX_DEPTH = 100
_MERGE = "tag:yaml.org,2002:merge"


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the last would win unseen) and
    a key that is a list or a mapping (no setting is named by one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # `<<: *defaults`: keys this mapping's own may override
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "a key must be a name or a number, not a list or a mapping", key_node.start_mark
                )
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str | bytes) -> Any:
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 (a safe loader)


def _too_large(value: Any, depth: int = 0) -> str | None:
    """Why `value` (at `depth` levels down already) is too large to be settings, or None: each
    alias counted as often as it appears, so that what a later reader expands is what is counted;
    the walk stops at the bound, never expanding it."""
    count, stack = 1, [(value, depth + 1)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            return f"nested more than {MAX_DEPTH} levels deep"
        children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else []
        count += len(children) * (2 if isinstance(node, dict) else 1)  # a mapping's keys are values too
        if count > MAX_VALUES:
            return (
                f"expands to more than {MAX_VALUES:,} values (anchors repeated through aliases, or one that "
                "holds itself)"
            )
        stack.extend((child, level + 1) for child in children)
    return None


def _config_bytes(uri: str) -> bytes:
    """A config file's bytes: a regular file (not a device, pipe or folder, which could be read
    without end or block) of at most MAX_CONFIG_BYTES."""
    from dflash_ray import storage

    too_big = f"is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config file"
    if storage.is_s3(uri):
        if storage.size(uri) > MAX_CONFIG_BYTES:
            raise DFlashError(too_big, file=uri)
        return storage.read_bytes(uri)
    fd = os.open(storage.local_path(uri), os.O_RDONLY | os.O_NONBLOCK)  # a pipe must not block the open
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DFlashError("not a regular file (a device, pipe or folder): give a YAML file", file=uri)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise DFlashError(too_big, file=uri)
    return data


def read_yaml(uri: str) -> Any:
    """A YAML file's value, read with every guard of a config file: a regular file of bounded size,
    unique plain keys, bounded nesting and expansion; each fault refused naming the file."""
    data = _config_bytes(uri)
    try:
        loaded = _load_yaml(data)
    except yaml.YAMLError as e:
        raise DFlashError(f"invalid YAML: {e}", file=uri) from None
    except RecursionError:
        raise DFlashError(f"nested more than {MAX_DEPTH} levels deep: not a config file", file=uri) from None
    reason = _too_large(loaded)
    if reason is not None:
        raise DFlashError(f"{reason}: not a config file", file=uri)
    return loaded


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (`1`, `true`, `[1]`)."""
    if "=" not in assignment:
        raise DFlashError(f"override {assignment!r} must look like a.b=value", field="--set")
    path, raw = assignment.split("=", 1)
    keys = path.strip().split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise DFlashError(f"{key} is not a section", field=path)
    where = f"--set {'.'.join(keys)}"
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise DFlashError(
            f"{raw!r} is not a YAML value ({str(e).splitlines()[0]}); quote a string, write a list as [a, b]",
            field=where,
        ) from None
    except RecursionError:
        raise DFlashError(f"nested more than {MAX_DEPTH} levels deep", field=where) from None
    reason = _too_large(value, depth=len(keys))
    if reason is not None:
        raise DFlashError(reason, field=where)
    node[keys[-1]] = value


def merge_settings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings merge key by key, any other value (a list too) replaces."""
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_settings(out[key], value) if nested else value
    return out


def read_settings(path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config file's mapping; a top-level `base: FILE` (relative to this file's folder) is read
    first and this file's settings go on top of it, so a variant of a preset states only what differs."""
    from dflash_ray import storage

    if path in seen:
        raise DFlashError(f"`base` files form a loop: {' -> '.join(seen + (path,))}", file=path, field="base")
    loaded = read_yaml(path) or {}
    if not isinstance(loaded, dict):
        raise DFlashError("a config file must hold a mapping", file=path)
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str) or not base:
        raise DFlashError(f"{base!r}: allowed: the path of another config file", file=path, field="base")
    if "://" not in base and not base.startswith("/"):
        base = storage.join(storage.parent(path), base)
    if not storage.is_s3(base):
        base = os.path.normpath(base)  # one file, one name: how a loop is seen
    return merge_settings(read_settings(base, seen + (path,)), loaded)


def load_config(
    path: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    check: Callable[[RunConfig], None] | None = None,
) -> RunConfig:
    """Build the run config from an optional YAML file (path or URI) and dotted overrides. `check`:
    more rules, from a floor above this one (`preflight.check_settings`: what only the code that owns
    a setting can read), whose errors are named as the config's own are (the --set, or the file)."""
    if path is not None and not str(path).strip():
        raise DFlashError("is empty (an unset variable?): give a config file, or leave --config out", field="--config")
    data = read_settings(path) if path else {}
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        cfg = build(RunConfig, data)
        if check is not None:
            check(cfg)
        return cfg
    except DFlashError as e:
        if e.file is not None:
            raise
        given = [a for a in overrides if e.field and _touches(a.split("=", 1)[0].strip(), e.field)]
        if given:  # the command line's, not the file's
            raise DFlashError(f"{e.message} (given by --set {given[-1]})", field=e.field) from None
        if path:
            raise DFlashError(str(e), file=path) from None
        raise


def _touches(key: str, field: str) -> bool:
    """Whether an override of `key` sets `field` (or a section holding it, or a field inside it)."""
    return key == field or field.startswith(f"{key}.") or key.startswith(f"{field}.")


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return build(RunConfig, data)
