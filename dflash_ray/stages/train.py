"""`dflash-ray train`: resolves the run on the driver, once (`preflight.resolve_run`: the settings,
the pinned target, the placement, each drafter's shape, start and folder, the memory fit), starts the
coordinator actor (`train.coordinator`) on what it decided and follows it with a progress bar; the
metrics plot is drawn from `metrics.jsonl` at the end, and the summary's `resolved` section says what
ran. The coordinator's own errors reach the caller as they were raised."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from dflash_ray import disk, storage
from dflash_ray.cluster import on_node
from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError, DiskFull, Interrupted, note_sigterm
from dflash_ray.stages import PipelineRun, Stage
from dflash_ray.train import drafters
from dflash_ray.train.trackers import driver_env

if TYPE_CHECKING:
    from dflash_ray.train.resolved import ResolvedRun


def plot_metrics(metrics: list[dict[str, Any]]) -> bytes:
    from dflash_ray.plots import COLOR, png_figure

    steps = [m["step"] for m in metrics]
    with png_figure(3, (12, 3.2)) as (_, axes, buf):
        for ax, key, title in zip(
            axes, ("loss", "tau", "tokens_per_s"), ("loss", "simulated acceptance length", "tokens/s")
        ):
            ax.plot(steps, [m[key] for m in metrics], color=COLOR, label="train batches")
            ax.set_title(title)
            ax.set_xlabel("step")
        held = [m for m in metrics if m.get("heldout_tau") is not None]
        if held:
            axes[1].plot(
                [m["step"] for m in held], [m["heldout_tau"] for m in held], "o-", color="#c0504d", label="held-out"
            )
            axes[1].legend()
    return buf.getvalue()


def _interrupted(output: str) -> Interrupted:
    """Where a run stopped by Ctrl-C can go on from: the same command resumes from its newest checkpoint."""
    from dflash_ray.train import checkpoint

    done = checkpoint.complete_steps(output)
    where = (
        f"its last checkpoint is step {done[-1]} ({checkpoint.step_dir(output, done[-1])})"
        if done
        else "no checkpoint was written yet, so it starts over"
    )
    return Interrupted(f"interrupted; {where}: run the same command with --resume to go on", file=output)


def run_train(
    target: str,
    data: str,
    output: str,
    cfg: RunConfig,
    *,
    stop_after_step: int | None = None,
    progress: bool = True,
    run_name: str | None = None,
    resume: bool | None = None,
) -> dict[str, Any]:
    """Train, resuming from the newest complete checkpoint in `output` when there is one (`resume`
    False: refuse an output holding checkpoints; True: warn when it holds none). `stop_after_step`
    ends the run (with a checkpoint) after that step, to train in slices. Everything that reads only
    settings and storage is checked before Ray starts: the output is claimed for this run (`writer`),
    and a checkpoint to resume from is compared with this run's settings, data and target."""
    from dflash_ray import writer
    from dflash_ray.train import checkpoint
    from dflash_ray.preflight import resolve_run

    storage.require_folder(output, "nothing was trained")
    if storage.overlaps(data, output):  # checkpoints and metrics would land among the data's shards
        raise DFlashError(
            f"the output {output} and the data {data} overlap (one is, or is inside, the other): choose an "
            "output folder of its own",
            file=output,
        )
    _refuse_untokenized(data)
    run = resolve_run(target, cfg, output)  # the whole run decided once: from here on it is executed
    # one run trains into an output of ours; a second, or a folder of the user's files, is refused at once

    def ours_if() -> bool:  # an output an earlier version wrote, unmarked, shows itself by its checkpoints
        return bool(checkpoint.complete_steps(output))

    with writer.output(output, "training", what="nothing was trained", ours_if=ours_if):
        _check_checkpoints(run, data, output, resume)
        try:
            return _train(run, data, output, stop_after_step, progress, run_name)
        except DFlashError as e:
            if isinstance(e, (DiskFull, Interrupted)) or not disk.no_space(e):
                raise
            raise _disk_full(e, output, cfg) from None


def _refuse_untokenized(data: str) -> None:
    """A dataset of prompts or completions, by its manifest's kind, named on the driver: before Ray
    starts and resources are checked (the coordinator reads every file's columns again)."""
    from dflash_ray import manifest
    from dflash_ray.data.tokenized import NOT_TOKENIZED

    found = manifest.read_manifest(data)
    kind = str(found.get("kind", "")) if isinstance(found, dict) else ""
    if kind.startswith("prompts") or kind == "completions":  # prompts-jsonl: `selfprompt`'s chats
        raise DFlashError(NOT_TOKENIZED["completions" if kind == "completions" else "prompts"], file=data)


def _disk_full(e: DFlashError, output: str, cfg: RunConfig) -> DiskFull:
    """A run the actors' restarts could not carry past a full disk (a checkpoint's files): the path
    and the space, and the temporary files of the checkpoints it left unfinished removed."""
    import re

    from dflash_ray.train import checkpoint

    removed = 0
    for folder in drafters.outputs(output, cfg):
        complete = set(checkpoint.complete_steps(folder))
        for step_dir in storage.list_dirs(storage.join(folder, "checkpoints")):
            if storage.is_s3(step_dir) or checkpoint.step_of(step_dir) in complete:
                continue
            for tmp in storage.local_path(step_dir).rglob(".*.tmp"):  # half-copied shards, never listed
                tmp.unlink(missing_ok=True)
                removed += 1
    found = re.findall(r"No space left on device: '[^']*'(?: -> '([^']+)')?|No space left on device: '([^']+)'", str(e))
    path = next((a or b for a, b in reversed(found) if a or b), output)
    name = storage.basename(path)
    if name.startswith(".") and name.endswith(".tmp"):  # the temporary a copy was writing: the file it was for
        path = storage.join(storage.parent(path), name[1:-4])
    full = disk.disk_full(path)
    return DiskFull(
        f"{full.message} (while training; the restarts could not get past it: {removed} temporary files of an "
        "unfinished checkpoint removed); the same command with --resume goes on from the last checkpoint",
        file=path,
    )


def _check_checkpoints(run: ResolvedRun, data: str, output: str, resume: bool | None) -> None:
    """On storage alone, before Ray: an output holding checkpoints without `resume` is refused, and the
    newest checkpoint to resume from must be of this run (settings, data and its content, target:
    `recovery.differences`, as the coordinator checks it; the data's print reads its manifest alone, so
    a rewritten dataset is refused before any actor loads the target). A raised or
    lowered `train.max_steps` is a longer or shorter run: the learning-rate schedule is recomputed
    over the new total from the checkpoint's step on, and the log says so."""
    from dflash_ray import manifest
    from dflash_ray.train import checkpoint
    from dflash_ray.train.recovery import Origin, differences

    cfg = run.cfg
    for folder in (d.output for d in run.drafters):
        steps = checkpoint.complete_steps(folder)
        if resume is False and steps:
            raise DFlashError(
                "holds checkpoints of an earlier run: pass --resume to continue it, or choose another --output",
                file=storage.join(folder, "checkpoints"),
            )
        if resume and not steps:
            print(
                f"dflash-ray train: warning: --resume, but {folder} holds no complete checkpoint: training "
                "starts at step 0",
                file=sys.stderr,
            )
    if cfg.train.drafters or not checkpoint.complete_steps(output):
        return  # several drafters: each one's checkpoint is compared by the coordinator
    step = checkpoint.complete_steps(output)[-1]
    try:
        state = json.loads(checkpoint.read_file(output, step, "state.json", checkpoint.verify(output, step)))
    except checkpoint.CorruptCheckpoint:
        return  # the coordinator resumes from an older one, or says none verifies
    changed = differences(state, Origin(cfg, run.target, data, manifest.fingerprint(data), output))
    if changed:
        raise DFlashError(
            f"the checkpoint {checkpoint.step_dir(output, step)} was made with other settings ({', '.join(changed)} "
            "differ): resuming would not continue the same run; set them as they were, or choose another --output",
            file=output,
        )
    before = state.get("config", {}).get("train", {}).get("max_steps", 0)
    if before != cfg.train.max_steps:
        print(
            f"dflash-ray train: warning: train.max_steps {before or 'unset'} -> {cfg.train.max_steps or 'unset'}: "
            f"the run goes on from step {step}, its learning-rate schedule (warmup, cosine decay to zero) recomputed "
            "over the new total: the rate rises again from where the old schedule had taken it",
            file=sys.stderr,
        )


class _Progress:
    """The bar, and a line for each step this run trained since the last look."""

    def __init__(self, coordinator: Any, progress: bool):
        self.coordinator = coordinator
        self.progress = progress
        self.bar: Any = None
        self.seen = 0  # metric rows read
        self.printed = -1  # the last step given a line

    def show(self) -> None:
        import ray
        from tqdm import tqdm

        from dflash_ray.train.profile import step_line

        state = ray.get(self.coordinator.progress.remote(self.seen))
        if state["total_steps"] is None or state["begun_at"] is None:  # still planning or resuming
            return
        if self.bar is None:
            self.bar = tqdm(total=state["total_steps"], desc="train", unit=" steps", disable=not self.progress)
        # a restart takes the metrics back to its checkpoint's step: read them again from there
        self.seen = state["count"] if state["count"] < self.seen else self.seen + len(state["rows"])
        self.printed = max(self.printed, state["begun_at"])
        for row in state["rows"] if self.progress else []:  # one line per step, on stderr
            if row["step"] > self.printed:
                self.bar.write(step_line(row, state["total_steps"]), file=sys.stderr)
                self.printed = row["step"]
        self.bar.n = state["step"]
        if state["last"]:
            self.bar.set_postfix(loss=f"{state['last']['loss']:.3f}", tau=f"{state['last']['tau']:.2f}")
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _catch_stop_signals(interrupted: threading.Event) -> tuple[Any, Any] | None:
    """Ctrl-C, and SIGTERM (Kubernetes, `ray job stop`) as Ctrl-C, set a flag the loop reads between
    waits: a KeyboardInterrupt raised inside Ray's own (Cython) wait can surface as a SystemError
    instead. The handlers replaced, to restore; None off the main thread, where none can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())

    def terminated(*_) -> None:
        note_sigterm()
        interrupted.set()

    return previous, signal.signal(signal.SIGTERM, terminated)


def _restore_signals(handlers: tuple[Any, Any] | None) -> None:
    if handlers is not None:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


def _measured_network(cfg: RunConfig) -> dict[str, Any] | None:
    """The network measured first where several streams need it: a slow link is said before a slow run."""
    if cfg.train.min_bus_bandwidth > 0 and cfg.train.num_streams > 1:
        from dflash_ray.train.network import check_floor, measure

        network = measure(cfg.train)
        check_floor(network, cfg.train.min_bus_bandwidth)
        return network
    return None


def _follow(run_ref: Any, shown: _Progress, interrupted: threading.Event) -> dict[str, Any]:
    """Wait for the coordinator's run, showing its progress, until it ends or a stop signal came."""
    import ray

    while not ray.wait([run_ref], timeout=1.0)[0]:
        if interrupted.is_set():
            raise KeyboardInterrupt
        shown.show()
    try:
        shown.show()  # the steps since the last look
    except ray.exceptions.RayError:  # the coordinator is gone: its run's own outcome says why
        pass
    return ray.get(run_ref)


def _plot_each_drafter(run: ResolvedRun, summary: dict[str, Any]) -> None:
    """Each drafter's metrics plot beside its `metrics.jsonl`, named in the summary."""
    for name, folder in ((d.name, d.output) for d in run.drafters):
        metrics_uri = storage.join(folder, "metrics.jsonl")
        if storage.exists(metrics_uri):
            metrics = [json.loads(x) for x in storage.read_text(metrics_uri).splitlines() if x.strip()]
            if metrics:
                storage.write_bytes(storage.join(folder, "metrics.png"), plot_metrics(metrics))
                (summary["drafters"][name] if name else summary)["metrics_png"] = storage.join(folder, "metrics.png")


def _train(
    run: ResolvedRun,
    data: str,
    output: str,
    stop_after_step: int | None,
    progress: bool,
    run_name: str | None,
) -> dict[str, Any]:
    import uuid

    import ray

    from dflash_ray.cluster import connect
    from dflash_ray.train.coordinator import Coordinator
    from dflash_ray.train.devices import check_resources

    cfg = run.cfg
    connect(cfg.ray)
    check_resources(cfg.train, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    network = _measured_network(cfg)
    run_name = run_name or f"dflash-train-{uuid.uuid4().hex[:8]}"
    # an actor handle: Ray's typing does not give its methods a `.remote`
    coordinator: Any = (
        ray.remote(Coordinator)
        .options(num_cpus=0, max_concurrency=2, resources=on_node(cfg.ray.head_resource))
        .remote(run, data, output, run_name, driver_env())
    )
    run_ref = coordinator.run.remote(stop_after_step)
    shown = _Progress(coordinator, progress)
    interrupted = threading.Event()
    handlers = _catch_stop_signals(interrupted)
    try:
        summary = _follow(run_ref, shown, interrupted)
        if network:
            summary["network"] = {k: network[k] for k in ("all_reduce_bus_gbs", "slowest_pair")}
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, DFlashError):  # the coordinator's own error, as it raised it
            raise e.cause from None
        raise
    except KeyboardInterrupt:
        try:
            ray.get(coordinator.stop.remote(), timeout=60)
        except Exception:  # the coordinator is gone already: so are its actors
            pass
        raise _interrupted(output) from None
    finally:
        _restore_signals(handlers)
        shown.close()
        ray.kill(coordinator)
    _plot_each_drafter(run, summary)
    for d in run.drafters:  # how each drafter started: the target's layers, random, or a released one
        (summary["drafters"][d.name] if d.name else summary)["start"] = d.init  # "drafter:FOLDER" for a released one
    summary["resolved"] = run.section()  # what ran: the placement, each drafter's shape and start
    return summary


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.chaos import Injector

    with Injector(cfg.chaos) as chaos:  # `chaos.faults`: a drill, killing actors (or a node) while it trains
        summary = run_train(
            args.target,
            args.data,
            args.output,
            cfg,
            stop_after_step=args.stop_after_step,
            progress=not args.json,
            resume=args.resume,
        )
    if cfg.chaos.faults:
        summary["chaos"] = chaos.summary()
    return summary


def _at_least_one(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, metavar="URI", help="tokenized dataset (from `dflash-ray tokenize`)")
    p.add_argument("--target", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--output", required=True, metavar="URI", help="checkpoints, metrics.jsonl and metrics.png")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--stop-after-step", type=_at_least_one, metavar="N", help="end (with a checkpoint) after step N")


def _step(run: PipelineRun) -> dict[str, Any]:
    """Every drafter of `train.drafters` from one target pass; each one's figures go to export and
    evaluate (`run.results["train"]`: name → its training summary)."""
    cfg = run.cfg
    train = run.timed(
        "train", run_train, cfg.pipeline.target, run.at("tokenized"), run.at("train"), cfg, progress=run.progress
    )
    run.results["train"] = {name: train["drafters"][name] if name else train for name, _ in drafters.expand(cfg)}
    return {
        "training_steps": train["step"],
        "stream_nodes": train["stream_nodes"],
        "layout": train["layout"],
        "coordinator_node": train["coordinator_node"],
        "train_restarts": train["restarts"],
        "train_seconds_lost": train["seconds_lost"],
        "start": {name: result.get("start") for name, result in run.results["train"].items()}
        if len(run.results["train"]) > 1
        else train.get("start"),
    }


STAGES = (
    Stage(
        name="train",
        help="online training: target actors → drafter actors",
        command=_command,
        arguments=_arguments,
        section="train",
        order=50,
        inputs=("tokenized", "report"),
        outputs=("train",),
        step=_step,
    ),
)
