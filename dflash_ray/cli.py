"""`dflash-ray`: one command, a subcommand per stage.

Every subcommand takes `--config FILE` and repeated `--set a.b=value` overrides, prints a JSON
summary on stdout with `--json` (logs and progress go to stderr), and exits non-zero with a message
naming the file, record and field on bad input: 2 for bad input, 3 for a failed validation gate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import traceback
from typing import Any, Callable, Iterator, TextIO

from dflash_ray import environment, stages
from dflash_ray.config import RunConfig, load_config
from dflash_ray.preflight import check_settings
from dflash_ray.errors import (
    DFlashError,
    DiskFull,
    Interrupted,
    carried,
    catch_sigterm,
    failure_cause,
    release_sigterm,
    sigterm_received,
)


class UsageError(Exception):
    """A command line argparse refuses, raised instead of its exit so `--json` still ends with a summary."""


DRILLED = {"pipeline", "demo", "train"}  # the commands `chaos.faults` acts in


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.print_usage(sys.stderr)
        raise UsageError(f"{self.prog}: error: {message}")


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--config", help="run config YAML (path or URI)")
    common.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field, e.g. --set tokenize.max_seq_len=2048",
    )
    common.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    parser = _Parser(prog="dflash-ray", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for stage in stages.stages():  # every stage module's `STAGES`
        p = sub.add_parser(stage.name, parents=[common], help=stage.help)
        stage.arguments(p)
        p.set_defaults(run=stage.command)
    return parser


def _print_human(summary: dict[str, Any], prefix: str = "") -> None:
    """The summary as a two-column table; nested sections flattened to dotted keys."""
    for key, value in summary.items():
        nested = [isinstance(v, dict) for v in value.values()] if isinstance(value, dict) and value else None
        if nested and (all(nested) or not any(nested) and len(value) <= 8):  # sections, or a short flat mapping
            _print_human(value, f"{prefix}{key}.")
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        print(f"{prefix + key:>28}: {value}")


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float as null: `--json` prints JSON, never `NaN` or `Infinity`."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _file_in_the_way(e: OSError) -> str | None:
    """The existing file that stands where a folder was to be made or read ("Not a directory",
    "File exists" on a folder): the path itself or the nearest of its parents."""
    import errno
    from pathlib import Path

    if e.errno not in (errno.ENOTDIR, errno.EEXIST) or str(e.filename).startswith("s3://"):
        return None
    path = Path(str(e.filename).removeprefix("file://"))
    for candidate in (path, *path.parents):
        if candidate.exists():
            return str(candidate) if not candidate.is_dir() else None
    return None


def _user_error(e: Exception) -> DFlashError | None:
    """The user's error an exception stands for (a missing or unreadable file, a file in the way, a
    full disk, S3's refusal, an error of the project's own raised in a Ray worker); None for a bug."""
    from dflash_ray import disk

    if isinstance(e, FileNotFoundError):
        return DFlashError("no such file or object", file=e.filename or str(e))
    if isinstance(e, PermissionError):
        return DFlashError("permission denied", file=e.filename or str(e))
    if disk.no_space(e):  # here, or in a worker whose traceback says so
        path = e.filename if isinstance(e, OSError) else None
        named = re.search(r"No space left on device: '([^']+)'", str(e))
        path = path or (named.group(1) if named else None)
        if path:
            return disk.disk_full(path)
        return DiskFull(
            f"no space left on a device ({failure_cause(e)}): free space on the output's disk, the temporary "
            "folder's (TMPDIR) or the cache's (DFLASH_RAY_CACHE, ~/.cache)"
        )
    if isinstance(e, OSError) and e.filename is not None:  # a folder where a file was expected, a file in the way
        blocker = _file_in_the_way(e)
        if blocker is not None:
            return DFlashError("is a file where a folder is needed: it is left as it is; choose a folder", file=blocker)
        return DFlashError(f"{e.strerror or type(e).__name__}", file=e.filename)
    found = carried(e)
    if found is not None:
        return found
    if type(e).__module__.startswith("botocore"):  # S3: no bucket, no credentials, denied
        return DFlashError(f"S3: {e}")
    return None


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@contextlib.contextmanager
def summary_stdout(json_summary: bool) -> Iterator[TextIO]:
    """With `json_summary`, stdout carries the summary alone: what is printed inside (the worker logs
    Ray forwards to the driver, progress) goes to stderr, and the summary to the stream yielded. A Ray
    started inside is shut down on the way out: its log thread must not print after the summary."""
    out = sys.stdout
    if json_summary:
        sys.stdout = sys.stderr
    joined = _ray_initialized()
    try:
        yield out
    finally:
        if not joined and _ray_initialized():
            sys.modules["ray"].shutdown()
        sys.stdout = out


def _refused(e: UsageError, argv: list[str]) -> int:
    """A command line argparse refuses: said, and with `--json` the summary line a script reads, as
    for any other refusal."""
    print(e, file=sys.stderr)
    if "--json" in argv:
        stage = next((a for a in argv if not a.startswith("-")), None)
        print(json.dumps({"stage": stage, "ok": False, "error": str(e), "exit_code": 2}), flush=True)
    return 2


def _run_stage(args: argparse.Namespace) -> dict[str, Any]:
    run: Callable[[argparse.Namespace, RunConfig], dict[str, Any]] = args.run
    try:
        environment.check_all()  # a node's numbers from the environment, named before anything starts
        cfg = load_config(args.config, args.overrides, check=check_settings)
        if cfg.chaos.faults and args.command not in DRILLED | {"plan"}:  # plan checks a pipeline's config
            raise DFlashError(
                f"the fault drill runs in {' and '.join(sorted(DRILLED))} only: `{args.command}` "
                "would run without a fault; drop the setting, or drill the pipeline",
                field="chaos.faults",
            )
        return run(args, cfg)
    except KeyboardInterrupt:  # a stage that knows where it can resume from raises its own `Interrupted`
        raise Interrupted(
            "interrupted: what this run had committed stays, nothing half-written is listed; "
            "the same command goes on (generation and training resume where they were)"
        ) from None


def _internal_error(e: Exception, args: argparse.Namespace, out: TextIO) -> int:
    """Not an error of the input or settings (each of those is a DFlashError): a bug, said as one;
    an unexpected failure still ends with a summary line under `--json`."""
    traceback.print_exc()
    print(
        f"dflash-ray {args.command}: internal error: {type(e).__name__}: {e}\nThis is a bug in dflash-ray, "
        "not in your input: please report it with the traceback above",
        file=sys.stderr,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "stage": args.command,
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}"[-4000:],
                    "bug": True,
                    "exit_code": 1,
                }
            ),
            file=out,
            flush=True,
        )
    return 1


def _failed(e: DFlashError, args: argparse.Namespace, out: TextIO) -> int:
    if isinstance(e, Interrupted) and sigterm_received():  # stopped by SIGTERM, as by Ctrl-C
        e = Interrupted(f"SIGTERM: {e}")
        e.exit_code = 143
    print(f"dflash-ray {args.command}: error: {e}", file=sys.stderr)
    if args.json:
        failed = {"stage": args.command, "ok": False, "error": str(e), "exit_code": e.exit_code, **e.summary}
        print(json.dumps(_json_safe(failed), allow_nan=False), file=out, flush=True)
    return e.exit_code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(argv)
    except UsageError as e:
        return _refused(e, argv)
    previous_sigterm = catch_sigterm()  # SIGTERM stops a command as Ctrl-C does (exit 143)
    try:
        with summary_stdout(args.json) as out:
            try:
                try:
                    summary = _run_stage(args)
                except DFlashError:
                    raise
                except Exception as e:
                    clear = _user_error(e)
                    if clear is not None:
                        raise clear from None
                    return _internal_error(e, args, out)
            except DFlashError as e:
                return _failed(e, args, out)
    finally:
        release_sigterm(previous_sigterm)
    if args.json:
        print(json.dumps(_json_safe({"ok": True, **summary}), allow_nan=False), flush=True)
    else:
        _print_human(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
