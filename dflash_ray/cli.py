"""`dflash-ray`: one command, a subcommand per stage.

Every subcommand takes `--config FILE` and repeated `--set a.b=value` overrides, prints a JSON
summary on stdout with `--json` (logs and progress go to stderr), and exits non-zero with a message
naming the file, record and field on bad input: 2 for bad input, 3 for a failed validation gate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from typing import Any, Callable

from dflash_ray.config import RunConfig, load_config
from dflash_ray.errors import DFlashError, GateFailed, Interrupted


def _cmd_prompts(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    """`prompts`, and `responses` (the same stage, keeping each record's last answer)."""
    from dflash_ray.stages.prompts import run_prompts

    return run_prompts(
        args.input or [], args.output, cfg, progress=not args.json, responses=args.command == "responses"
    )


def _cmd_selfprompt(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    from dflash_ray.stages.selfprompt import run_selfprompt

    if args.count is not None:
        cfg = dataclasses.replace(cfg, selfprompt=dataclasses.replace(cfg.selfprompt, count=args.count))
    return run_selfprompt(args.model, args.output, cfg, progress=not args.json)


def _cmd_generate(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    from dflash_ray.stages.generate import run_generate

    changes = {k: v for k, v in (("generators", args.generators), ("name", args.name)) if v is not None}
    cfg = dataclasses.replace(cfg, generate=dataclasses.replace(cfg.generate, **changes))
    return run_generate(args.prompts, args.output, args.model, cfg, progress=not args.json)


def _named(cfg: RunConfig, name: str | None) -> RunConfig:
    import dataclasses

    return cfg if name is None else dataclasses.replace(cfg, generate=dataclasses.replace(cfg.generate, name=name))


def _cmd_scale(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.generate import scale

    return scale(args.count, _named(cfg, args.name))


def _cmd_pause(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.generate import pause

    return pause(args.command == "pause", _named(cfg, args.name))


def _cmd_status(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.generate import status

    return status(_named(cfg, args.name), args.output)


def _cmd_tokenize(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    from dflash_ray.stages.tokenize import run_tokenize

    if args.tokenizer:
        cfg = dataclasses.replace(cfg, tokenize=dataclasses.replace(cfg.tokenize, tokenizer=args.tokenizer))
    return run_tokenize(args.input, args.output, cfg)


def _cmd_validate(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.validate import run_validate

    report = run_validate(args.input, cfg, report_dir=args.report, tokenizer_name=args.tokenizer)
    summary = {k: report[k] for k in ("stage", "input", "tokenizer", "passed", "failed_rules", "rules")}
    summary["stats"] = {k: v for k, v in report["stats"].items() if k != "sources"}
    summary["report_dir"] = report.get("report_dir")
    if not report["passed"]:
        failed = "; ".join(f"{r['rule']}: {r['message']}" for r in report["rules"] if not r["passed"])
        raise GateFailed(f"validation gate failed: {failed}", file=args.input).with_summary(summary)
    return summary


def _cmd_export(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.export import run_export

    return run_export(args.checkpoint, args.out_dir, dtype=args.dtype)


def _cmd_evaluate(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.evaluate import run_evaluate

    return run_evaluate(
        args.drafter,
        args.target,
        args.prompts,
        cfg,
        heldout_uri=args.heldout,
        engine=args.engine,
        tokenizer_name=args.tokenizer,
        report_dir=args.report,
    )


def _cmd_train(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray import storage
    from dflash_ray.train import checkpoint
    from dflash_ray.stages.train import run_train

    from dflash_ray.train.drafters import outputs

    for output in outputs(args.output, cfg):
        if not args.resume and checkpoint.complete_steps(output):
            raise DFlashError(
                "holds checkpoints of an earlier run: pass --resume to continue it, or choose another --output",
                file=storage.join(output, "checkpoints"),
            )
        if args.resume and not checkpoint.complete_steps(output):
            print(
                f"dflash-ray train: warning: --resume, but {output} holds no complete checkpoint: training "
                "starts at step 0",
                file=sys.stderr,
            )
    return run_train(
        args.target, args.data, args.output, cfg, stop_after_step=args.stop_after_step, progress=not args.json
    )


def _cmd_demo(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.demo import demo_config, run_demo

    return run_demo(args.workdir, demo_config(args.config, args.overrides), progress=not args.json)


def _cmd_pipeline(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    from dflash_ray.stages.pipeline import run_pipeline

    changes = {k: v for k, v in (("workdir", args.workdir), ("target", args.target)) if v}
    if args.input:
        changes["inputs"] = args.input
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, **changes))
    return run_pipeline(cfg, progress=not args.json)


def _cmd_onesample(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.onesample import run_onesample

    return run_onesample(args.target, cfg, engine=args.engine)


def _cmd_netcheck(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.stages.netcheck import run_netcheck

    return run_netcheck(cfg, megabytes=args.megabytes, iters=args.iters)


def _cmd_plan(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    from dflash_ray.stages.plan import run_plan

    if args.cluster:
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, cluster=args.cluster))
    return run_plan(cfg)


INPUTS_HELP = (
    "JSONL/JSON/Parquet files or folders, hf://datasets/ORG/NAME[/CONFIG][@REVISION][:SPLIT]; "
    "optional when the config has a mix (prompts.sources)"
)


class UsageError(Exception):
    """A command line argparse refuses, raised instead of its exit so `--json` still ends with a summary."""


DRILLED = {"pipeline", "demo"}  # the commands `chaos.faults` acts in


def _at_least(low: int):
    """An argparse type: a whole number of at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    return parse


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

    p = sub.add_parser("prompts", parents=[common], help="normalize chat datasets into prompt shards")
    p.add_argument("--input", nargs="+", action="extend", metavar="URI", help=INPUTS_HELP)
    p.add_argument("--output", required=True, metavar="URI")
    p.set_defaults(run=_cmd_prompts)

    p = sub.add_parser(
        "responses",
        parents=[common],
        help="existing responses (the last assistant turns of chat datasets) as completions",
    )
    p.add_argument("--input", nargs="+", action="extend", metavar="URI", help=INPUTS_HELP)
    p.add_argument("--output", required=True, metavar="URI", help="a completions folder `dflash-ray tokenize` reads")
    p.set_defaults(run=_cmd_prompts)

    p = sub.add_parser("selfprompt", parents=[common], help="prompts the target writes itself (chat JSONL)")
    p.add_argument("--model", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--count", type=int, metavar="N", help="candidates to sample (selfprompt.count)")
    p.add_argument("--output", required=True, metavar="URI", help="folder; `dflash-ray prompts --input` reads it")
    p.set_defaults(run=_cmd_selfprompt)

    p = sub.add_parser("generate", parents=[common], help="regenerate every response with the target itself")
    p.add_argument("--prompts", required=True, metavar="URI", help="prompt shards (from `dflash-ray prompts`)")
    p.add_argument("--output", required=True, metavar="URI")
    p.add_argument("--model", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--generators", type=int, metavar="N", help="generator actors at the start (generate.generators)")
    p.add_argument("--name", help="run name that scale and status use (generate.name)")
    p.set_defaults(run=_cmd_generate)

    p = sub.add_parser("scale", parents=[common], help="change the generator count of a running generation")
    p.add_argument("what", choices=["generators"])
    p.add_argument("count", type=int, metavar="N")
    p.add_argument("--name", help="the generation's name (generate.name)")
    p.set_defaults(run=_cmd_scale)

    for command, what in (
        ("pause", "generators finish their shard and wait, engines loaded"),
        ("resume", "a paused generation goes on"),
    ):
        p = sub.add_parser(command, parents=[common], help=f"pause or resume a running generation: {what}")
        p.add_argument("--name", help="the generation's name (generate.name)")
        p.set_defaults(run=_cmd_pause)

    p = sub.add_parser("status", parents=[common], help="progress of a generation: shards, generators, tokens/s, ETA")
    p.add_argument("--name", help="a running generation's name (generate.name)")
    p.add_argument("--output", metavar="URI", help="read a stopped or finished generation's progress from here")
    p.set_defaults(run=_cmd_status)

    p = sub.add_parser("tokenize", parents=[common], help="completions → input_ids + loss_mask (Ray Data)")
    p.add_argument("--input", required=True, metavar="URI")
    p.add_argument("--output", required=True, metavar="URI")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="short name (qwen3, smollm2-135m-instruct) or path")
    p.set_defaults(run=_cmd_tokenize)

    p = sub.add_parser("validate", parents=[common], help="loss-mask statistics and the validation gate")
    p.add_argument(
        "--input",
        required=True,
        metavar="URI",
        help="tokenized dataset (input_ids, loss_mask): a Parquet file, a folder of Parquet files "
        "(from `dflash-ray tokenize` or not), or a Hugging Face `save_to_disk` folder",
    )
    p.add_argument("--report", metavar="DIR", help="write report.json, report.md and PNG histograms here")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="default: the one that tokenized the data")
    p.set_defaults(run=_cmd_validate)

    p = sub.add_parser("train", parents=[common], help="online training: target actors → drafter actors")
    p.add_argument("--data", required=True, metavar="URI", help="tokenized dataset (from `dflash-ray tokenize`)")
    p.add_argument("--target", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--output", required=True, metavar="URI", help="checkpoints, metrics.jsonl and metrics.png")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--stop-after-step", type=_at_least(1), metavar="N", help="end (with a checkpoint) after step N")
    p.set_defaults(run=_cmd_train)

    p = sub.add_parser("export", parents=[common], help="write a drafter in the format vLLM and SGLang load")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a training checkpoint or drafter folder (path or URI)")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.set_defaults(run=_cmd_export)

    p = sub.add_parser("evaluate", parents=[common], help="acceptance length of a drafter against its target")
    p.add_argument("--drafter", required=True, metavar="DIR")
    p.add_argument("--target", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--prompts", required=True, metavar="URI", help="prompt shards (from `dflash-ray prompts`)")
    p.add_argument("--heldout", metavar="URI", help="tokenized held-out set for the simulated tau")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="vllm: also report vLLM's measured tau")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="default: the target's own")
    p.add_argument(
        "--report",
        metavar="DIR",
        help="write evaluation.png there: acceptance by draft position "
        "and by prompt source, the drafter beside prompt lookup",
    )
    p.set_defaults(run=_cmd_evaluate)

    p = sub.add_parser(
        "onesample",
        parents=[common],
        help="overfit a drafter of the train settings on one answer; serving must accept it whole",
    )
    p.add_argument("--target", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="vllm: vLLM's acceptance must agree too")
    p.set_defaults(run=_cmd_onesample)

    p = sub.add_parser("pipeline", parents=[common], help="every stage in order on one config (pipeline.*)")
    p.add_argument("--input", nargs="+", action="extend", metavar="URI", help="raw datasets (pipeline.inputs)")
    p.add_argument("--workdir", metavar="URI", help="where every stage writes (pipeline.workdir)")
    p.add_argument("--target", metavar="PATH", help="target model (pipeline.target)")
    p.set_defaults(run=_cmd_pipeline)

    p = sub.add_parser(
        "netcheck",
        parents=[common],
        help="all-reduce bus bandwidth between the training ranks, per node pair (train.min_bus_bandwidth)",
    )
    p.add_argument("--megabytes", type=float, default=64.0, help="all-reduced by each rank (default 64)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces per measurement (default 5)")
    p.set_defaults(run=_cmd_netcheck)

    p = sub.add_parser("plan", parents=[common], help="projected GPU-hours and wall time of a workload")
    p.add_argument("--cluster", metavar="YAML", help="cluster launcher config to count GPUs in (plan.cluster)")
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("demo", parents=[common], help="run the pipeline on the embedded default")
    p.add_argument("--workdir", default="demo-run", metavar="DIR")
    p.set_defaults(run=_cmd_demo)
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


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        if "--json" in argv:  # the summary line a script reads, as for any other refusal
            stage = next((a for a in argv if not a.startswith("-")), None)
            print(json.dumps({"stage": stage, "ok": False, "error": str(e), "exit_code": 2}), flush=True)
        return 2
    run: Callable[[argparse.Namespace, RunConfig], dict[str, Any]] = args.run
    out = sys.stdout
    if args.json:  # stdout carries the summary alone: worker logs Ray forwards go to stderr
        sys.stdout = sys.stderr
    joined = _ray_initialized()
    try:
        try:
            cfg = load_config(args.config, args.overrides)
            if cfg.chaos.faults and args.command not in DRILLED | {"plan"}:  # plan checks a pipeline's config
                raise DFlashError(
                    f"the fault drill runs in {' and '.join(sorted(DRILLED))} only: `{args.command}` "
                    "would run without a fault; drop the setting, or drill the pipeline",
                    field="chaos.faults",
                )
            summary = run(args, cfg)
        except FileNotFoundError as e:
            raise DFlashError("no such file or object", file=e.filename or str(e)) from None
        except PermissionError as e:
            raise DFlashError("permission denied", file=e.filename or str(e)) from None
        except OSError as e:  # a folder where a file was expected, a file in the way, a full disk: the user's to fix
            if e.filename is None:
                raise
            raise DFlashError(f"{e.strerror or type(e).__name__}", file=e.filename) from None
        except KeyboardInterrupt:  # a stage that knows where it can resume from raises its own `Interrupted`
            raise Interrupted(
                "interrupted: what this run had committed stays, nothing half-written is listed; "
                "the same command goes on (generation and training resume where they were)"
            ) from None
        except DFlashError:
            raise
        except Exception as e:
            if type(e).__module__.startswith("botocore"):  # S3: no bucket, no credentials, denied
                raise DFlashError(f"S3: {e}") from None
            # not an error of the input or settings (each of those is a DFlashError): a bug, said as one
            traceback.print_exc()
            print(
                f"dflash-ray {args.command}: internal error: {type(e).__name__}: {e}\nThis is a bug in dflash-ray, "
                "not in your input: please report it with the traceback above",
                file=sys.stderr,
            )
            if args.json:  # an unexpected failure still ends with a summary line
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
    except DFlashError as e:
        print(f"dflash-ray {args.command}: error: {e}", file=sys.stderr)
        if args.json:
            failed = {"stage": args.command, "ok": False, "error": str(e), "exit_code": e.exit_code, **e.summary}
            print(json.dumps(_json_safe(failed), allow_nan=False), file=out, flush=True)
        return e.exit_code
    finally:
        if not joined and _ray_initialized():  # Ray's log thread must not print after the summary
            sys.modules["ray"].shutdown()
        sys.stdout = out
    if args.json:
        print(json.dumps(_json_safe({"ok": True, **summary}), allow_nan=False), flush=True)
    else:
        _print_human(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
