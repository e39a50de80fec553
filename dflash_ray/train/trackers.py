"""Experiment trackers (`train.trackers`): TensorBoard, Weights & Biases, MLflow.

Only the coordinator logs: it is the one process that sees every step, so each step is logged once
however many streams train. Each tracker is a small class over its library, imported when it starts,
so none is needed to train. Files go under `OUTPUT/tracking/{tensorboard,wandb,mlruns}`; with an
`s3://` output they are written in a local folder, copied there at every checkpoint and at the end,
and copied back when a run resumes, so a resumed run continues the same logs:

- TensorBoard: the same folder; the first event after a resume purges the steps an interrupted
  attempt wrote after its last checkpoint (`purge_step`), so a reader sees each step once.
- W&B: one run whose id is derived from the output, `resume="allow"`; online, it ignores steps it
  already holds; offline, each attempt is a folder and `wandb sync` puts them all in that one run.
- MLflow: a `file:` store unless MLFLOW_TRACKING_URI names another; one run, found again by its
  `dflash.run_key` tag; steps it already holds are not logged again (MLflow cannot remove a point).

A tracker that fails while logging warns once and is dropped: a full disk or a lost connection must
not end a run of days. A tracker that cannot start is an error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, cast

from dflash_ray import storage
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient
    from torch.utils.tensorboard import SummaryWriter
    from wandb import Run

MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # what each needs installed
INSTALL = "pip install 'dflash-ray[track]'"
# read on the driver and passed to the coordinator, which may run on another node with another environment
ENV = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")
PROJECT = "dflash-ray"  # W&B project and MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME say


def check_installed(names: list[str]) -> None:
    """Refuse, before any actor starts, a tracker whose package is missing."""
    missing = [n for n in names if importlib.util.find_spec(MODULES[n]) is None]
    if missing:
        raise DFlashError(f"{missing} not installed: {INSTALL}", field="train.trackers")


def driver_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ENV if k in os.environ}


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """Every numeric field of a metrics row but its step."""
    return {
        k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> dotted keys and string values (lists and mappings as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


class Tracker(Protocol):
    def start(self, run_name: str, config: dict, logdir: str) -> str:
        """Start logging the run (resumed if it exists); returns where it logs."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def finish(self) -> None: ...


class TensorBoard:
    def __init__(self, env: dict[str, str], run_key: str):
        self.writer: SummaryWriter | None = None
        self.logdir, self.config = "", ""
        self.writer_class: type[SummaryWriter] | None = None

    def start(self, run_name: str, config: dict, logdir: str) -> str:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.logdir, self.writer_class = logdir, SummaryWriter
        self.config = "\n".join("    " + line for line in yaml.safe_dump(config, sort_keys=False).splitlines())
        return logdir

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:  # the first step of this attempt: later steps of an earlier one are purged
            assert self.writer_class is not None  # set by `start`
            self.writer = self.writer_class(self.logdir, purge_step=step)
            self.writer.add_text("config", self.config, step)  # markdown: indented = verbatim
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    def __init__(self, env: dict[str, str], run_key: str):
        self.env, self.run_key = env, run_key
        self.run: Run | None = None

    def start(self, run_name: str, config: dict, logdir: str) -> str:
        import wandb

        folder = self.env.get("WANDB_DIR", logdir)
        Path(folder).mkdir(parents=True, exist_ok=True)
        mode = cast(Literal["online", "offline", "disabled", "shared"] | None, self.env.get("WANDB_MODE"))
        self.run = run = wandb.init(
            project=self.env.get("WANDB_PROJECT", PROJECT),
            entity=self.env.get("WANDB_ENTITY"),
            mode=mode,
            dir=folder,
            id=self.run_key,
            resume="allow",
            name=run_name,
            config=config,
            allow_val_change=True,  # operational settings may change on resume
            settings=wandb.Settings(console="off", disable_git=True, save_code=False, quiet=True),
        )
        # an online run has a url (WANDB_MODE=disabled: None, as before)
        return str(Path(run.dir).parent) if run.offline else cast(str, run.url)

    def log(self, step: int, values: dict[str, float]) -> None:
        assert self.run is not None  # set by `start`
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        import wandb

        if self.run is not None:
            self.run.finish()
        wandb.teardown()  # its service process ends with the run, not with the actor


class MLflow:
    def __init__(self, env: dict[str, str], run_key: str):
        self.env, self.run_key = env, run_key
        self.client: MlflowClient | None = None
        self.run_id: str | None = None
        self.logged_upto = 0

    def start(self, run_name: str, config: dict, logdir: str) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        uri = self.env.get("MLFLOW_TRACKING_URI")
        if uri is None:  # a file store needs no server or database, and is copied to S3 as files
            Path(logdir).mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it in maintenance mode
        self.client = client = MlflowClient(uri or Path(logdir).absolute().as_uri())
        name = self.env.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        found = client.search_runs([experiment_id], f"tags.`dflash.run_key` = '{self.run_key}'", max_results=1)
        if found:  # a resumed run: the steps it holds stay; its params were logged when it began
            self.run_id = run_id = found[0].info.run_id
            self.logged_upto = max((m.step for m in client.get_metric_history(run_id, "loss")), default=0)
            client.update_run(run_id, status="RUNNING")
        else:
            self.run_id = run_id = client.create_run(
                experiment_id, run_name=run_name, tags={"dflash.run_key": self.run_key}
            ).info.run_id
            params = [Param(k, v[:MAX_PARAM_VAL_LENGTH]) for k, v in flatten(config).items()]
            for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        return f"{uri or logdir} (run {self.run_id})"

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step > self.logged_upto:
            assert self.client is not None and self.run_id is not None  # set by `start`
            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        if self.client is not None and self.run_id is not None:  # the client is set first
            self.client.set_terminated(self.run_id)


CLASSES: dict[str, Callable[[dict[str, str], str], Tracker]] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
    "mlflow": MLflow,
}
FOLDERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlruns"}


class Trackers:
    """The run's trackers; with an `s3://` output, their local folder and its copy next to the checkpoints."""

    def __init__(self, names: list[str], output: str, env: dict[str, str]):
        self.names, self.env = list(names), env
        self.active: dict[str, Tracker] = {}
        self.remote = storage.join(output, "tracking")
        self.run_key = "dflash-" + hashlib.sha1(output.rstrip("/").encode()).hexdigest()[:16]
        self.local: str | None = None
        self.uploaded: dict[str, tuple[int, int]] = {}
        self.logged = 0  # the last step logged: steps replayed after an actor restart are not logged again

    def start(self, run_name: str, config: dict) -> dict[str, str]:
        """Start each tracker; returns where each logs."""
        if not self.names:
            return {}
        if storage.is_s3(self.remote):
            self.local = tempfile.mkdtemp(prefix="dflash-tracking-")
            storage.download_tree(self.remote, self.local)  # a resumed run continues its logs
        root = self.local or self.remote
        where = {}
        for name in self.names:
            tracker = CLASSES[name](self.env, self.run_key)
            try:
                place = tracker.start(run_name, config, str(Path(root) / FOLDERS[name]))
            except Exception as e:
                self.finish()
                raise DFlashError(
                    f"the {name} tracker did not start: {type(e).__name__}: {e}", field="train.trackers"
                ) from e
            self.active[name] = tracker
            where[name] = place.replace(self.local, self.remote) if self.local else place
        return where

    def _guard(self, name: str, what: str, call) -> None:
        try:
            call()
        except Exception as e:
            print(
                f"warning: the {name} tracker failed to {what} ({type(e).__name__}: {e}); training goes on without it",
                file=sys.stderr,
                flush=True,
            )
            tracker = self.active.pop(name, None)
            if tracker is not None and what != "finish":
                try:  # its resources (W&B's service process) still go
                    tracker.finish()
                except Exception:
                    pass

    def log(self, step: int, row: dict[str, Any]) -> None:
        if step <= self.logged:
            return
        self.logged = step
        values = scalars(row)
        for name, tracker in list(self.active.items()):
            self._guard(name, "log", lambda: tracker.log(step, values))

    def log_rows(self, step: int, rows: dict[str, dict[str, Any]]) -> None:
        """Each drafter's row of `step` (by name; "" for a run's only drafter): one drafter's as it is,
        several in one run of the tracker, each figure under its drafter's name."""
        if len(rows) == 1:
            self.log(step, next(iter(rows.values())))
        else:
            self.log(step, {f"{name}/{k}": v for name, row in rows.items() for k, v in row.items() if k != "step"})

    def sync(self) -> None:
        """At a checkpoint: flush, and copy the local folder to an `s3://` output."""
        for name, tracker in list(self.active.items()):
            self._guard(name, "flush", tracker.flush)
        if self.local:
            try:
                storage.upload_tree(self.local, self.remote, skip=self.uploaded)
            except Exception as e:  # the next checkpoint tries again
                print(
                    f"warning: copying the trackers' files to {self.remote} failed ({e})", file=sys.stderr, flush=True
                )

    def finish(self) -> None:
        for name, tracker in list(self.active.items()):
            self._guard(name, "finish", tracker.finish)
        self.active = {}
        if self.local:
            self.sync()
            shutil.rmtree(self.local, ignore_errors=True)
            self.local = None
