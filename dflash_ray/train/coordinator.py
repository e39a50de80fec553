"""`dflash-ray train`: the coordinator drives N target→drafter streams.

The coordinator owns the run: a deterministic, seeded sample order per epoch, split over the
streams; each stream's target computes the features of step t+1 while its drafter trains on step
t (`max_in_flight` batches ahead, so memory stays flat). Features go from a target to its drafter as
an object reference the drafter resolves itself; with `train.colocate` a stream is one actor and its
features never leave the device. Gradients are averaged among the drafters by all-reduce (NCCL
between GPUs, gloo on the CPU), whose rendezvous is drafter rank 0's own node. The coordinator only
handles sample ids, references and figures.

Checkpoints every `checkpoint_every` steps and at the end: drafter rank 0 writes the weights and
optimizer state, the coordinator adds the run state (step, every drafter's anchor RNG) and commits
the manifest last. The data position follows from the step and the seed, and the learning rate
from the step, so a resume from step k replays exactly what an uninterrupted run does. An actor
that dies is replaced: every actor restarts from the last checkpoint, up to `max_restarts`.
"""

from __future__ import annotations

import collections
import json
import socket
import time
from typing import Any

from dflash_ray import storage
from dflash_ray.cluster import on_node
from dflash_ray.config import RunConfig
from dflash_ray.drafter.families import mask_and_layer_ids
from dflash_ray.errors import DFlashError
from dflash_ray.train import checkpoint
from dflash_ray.train.devices import placement
from dflash_ray.train.trackers import Trackers, check_installed, driver_env
from dflash_ray.train.workers import ColocatedWorker, DrafterWorker, TargetWorker


def drafter_config(target: str, cfg: RunConfig) -> dict:
    from transformers import AutoConfig

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import to_hf_config
    from dflash_ray.registry import config_dir

    tcfg = cfg.train
    target_cfg = AutoConfig.from_pretrained(config_dir(target))
    text = getattr(target_cfg, "text_config", None) or target_cfg
    special = tuple(t for t in (getattr(text, "bos_token_id", None), getattr(text, "eos_token_id", None),
                                getattr(text, "pad_token_id", None)) if isinstance(t, int))
    mask_id = tcfg.mask_token_id if tcfg.mask_token_id is not None else next(
        i for i in range(text.vocab_size - 1, -1, -1) if i not in special)
    try:
        dcfg = from_target(target_cfg, mask_token_id=mask_id, num_layers=tcfg.num_layers,
                           num_target_features=tcfg.num_target_features, target_layer_ids=tcfg.target_layer_ids,
                           layer_types=tcfg.layer_types, sliding_window=tcfg.sliding_window,
                           block_size=tcfg.block_size, special_token_ids=special, num_heads=tcfg.num_heads,
                           num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim,
                           intermediate_size=tcfg.intermediate_size, family=tcfg.drafter,
                           markov_rank=tcfg.markov_rank)
    except ValueError as e:  # a drafter shape the target cannot have
        raise DFlashError(str(e), field="train") from None
    return to_hf_config(dcfg, planned_placement(cfg).dtype)


def check_mask_row(target: str, drafter_cfg: dict) -> None:
    """Every mask query starts from the mask token's embedding row: a zero (untrained, padding) row
    makes them all the same after the norm. Refused when its norm is near zero against the table's."""
    import torch

    from dflash_ray.registry import resolve
    from dflash_ray.target.capture import embedding_rows

    mask_id = mask_and_layer_ids(drafter_cfg)[0]
    vocab = drafter_cfg["vocab_size"]
    sample = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:256].tolist()
    norms = embedding_rows(resolve(target), [mask_id] + sample).norm(dim=-1)
    typical = float(norms[1:].median())
    if float(norms[0]) < 0.05 * typical:
        raise DFlashError(f"the embedding row of mask token {mask_id} has norm {float(norms[0]):.3g} against a "
                          f"typical {typical:.3g}: an untrained row; choose a trained token",
                          field="train.mask_token_id")


def planned_placement(cfg: RunConfig):
    """The placement the stream actors will choose, checked on the driver (which may hold no GPU)."""
    tcfg = cfg.train
    try:
        return placement(tcfg.actor_gpus, 1 if tcfg.actor_gpus > 0 else 0, tcfg.dtype, tcfg.attention)
    except ValueError as e:
        raise DFlashError(str(e), field="train.attention") from None


def drafter_init(target: str, cfg: RunConfig) -> str:
    """How the drafter starts ("target" or "random"), checked on the driver before any actor."""
    from transformers import AutoConfig

    from dflash_ray.drafter.init import init_mode
    from dflash_ray.registry import config_dir

    try:
        return init_mode(AutoConfig.from_pretrained(config_dir(target)), cfg.train.init)
    except ValueError as e:
        raise DFlashError(str(e), field="train.init") from None


class Schedule:
    """Which samples each stream trains on at each step: a seeded permutation per epoch."""

    def __init__(self, samples: list[tuple[str, int]], num_streams: int, batch_size: int, seed: int):
        self.samples, self.streams, self.batch, self.seed = samples, num_streams, batch_size, seed
        self.steps_per_epoch = len(samples) // (num_streams * batch_size)
        if self.steps_per_epoch == 0:
            raise DFlashError(f"{len(samples)} samples are fewer than one step of {num_streams} streams "
                              f"x {batch_size} sequences")
        self._epoch, self._order = -1, None

    def batch_for(self, step: int, stream: int) -> list[tuple[str, int]]:
        import torch

        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(
                self.seed * 7919 + epoch)).tolist()
            self._epoch = epoch
        start = (i * self.streams + stream) * self.batch
        return [self.samples[j] for j in self._order[start:start + self.batch]]


def dataset_samples(data: str) -> list[tuple[str, int]]:
    """(file, row) of every sample of a tokenized dataset in any layout `open_tokenized` reads."""
    from dflash_ray.data.tokenized import open_tokenized

    dataset = open_tokenized(data)
    return [(uri, r) for uri, n in zip(dataset.files, dataset.row_counts()) for r in range(n)]


def sample_prompts(samples: list[tuple[str, int]]) -> list[str]:
    """The prompt each sample answers (several completions of one prompt share it)."""
    import pyarrow.parquet as pq

    from dflash_ray.generation.shard import prompt_of

    ids: dict[str, list] = {}
    for uri in dict.fromkeys(uri for uri, _ in samples):
        fs, path = storage.arrow_filesystem(uri)
        ids[uri] = pq.read_table(path, filesystem=fs, columns=["id"]).column("id").to_pylist()
    return [prompt_of(str(ids[uri][row])) for uri, row in samples]


def split_heldout(samples: list, count: int, seed: int, prompts: list[str] | None = None) -> tuple[list, list]:
    """A seeded choice of at least `count` held-out samples, and the rest (both in dataset order).

    With `prompts`, whole prompts are held out: no completion of a held-out prompt is trained on.
    """
    import torch

    if count <= 0:
        return [], samples
    prompts = prompts or [str(i) for i in range(len(samples))]
    sizes = collections.Counter(prompts)
    unique = list(sizes)
    chosen: set[str] = set()
    held = 0
    for i in torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed + 104729)).tolist():
        if held >= count:
            break
        chosen.add(unique[i])
        held += sizes[unique[i]]
    if held >= len(samples):
        raise DFlashError(f"{count} leaves no training sample out of {len(samples)}", field="train.heldout")
    return ([s for s, p in zip(samples, prompts) if p in chosen], [s for s, p in zip(samples, prompts) if p not in chosen])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node(_worker) -> str:
    """Run inside a stream actor (`__ray_call__`): the address of the node it runs on."""
    import ray

    return ray.util.get_node_ip_address()


def _rendezvous(_worker) -> tuple[str, int]:
    """Run inside drafter rank 0 (`__ray_call__`): its node's address and a port free there, where
    its process group store will listen."""
    import ray

    return ray.util.get_node_ip_address(), _free_port()


# settings that change how a run executes, not what it trains: free to differ on resume
OPERATIONAL = {"actor_cpus", "actor_gpus", "torch_threads", "max_in_flight", "checkpoint_every",
               "keep_checkpoints", "max_restarts", "eval_every", "colocate", "node_resource", "trackers"}


class Coordinator:
    def __init__(self, target: str, data: str, output: str, cfg: RunConfig, run_name: str, drafter_cfg: dict,
                 init: str, tracking_env: dict[str, str] | None = None):
        """`drafter_cfg` and `init`: `drafter_config` and `drafter_init`, computed on the driver;
        `tracking_env`: the trackers' settings from the driver's environment."""
        self.target, self.data, self.output, self.cfg = target, data, output, cfg
        self.run_name = run_name  # actors are named `{run_name}-target-{s}` / `-drafter-{s}`
        self.heldout, self.schedule, self.total_steps = [], None, None  # `_plan`, in `run`
        self.drafter_cfg_json = json.dumps(drafter_cfg)
        self.layer_ids = mask_and_layer_ids(drafter_cfg)[1]
        self.init = init
        self.step, self.restarts, self.metrics = 0, 0, []
        self.targets, self.drafters, self.groups = [], [], []
        self.rendezvous: tuple[str, int] | None = None
        self.stream_nodes: set[str] = set()  # every node a stream actor ran on, over restarts too
        self._gauges: dict[str, Any] = {}
        self.trackers = Trackers(cfg.train.trackers, output, tracking_env or {})

    def _plan(self) -> None:
        """The samples, the held-out split and the schedule. Run inside `run`, not the constructor, so
        a bad dataset or setting reaches the driver as its own error, not as a dead actor."""
        tcfg = self.cfg.train
        samples = dataset_samples(self.data)
        prompts = sample_prompts(samples) if tcfg.heldout > 0 else None
        self.heldout, train_samples = split_heldout(samples, tcfg.heldout, tcfg.seed, prompts)
        self.schedule = Schedule(train_samples, tcfg.num_streams, tcfg.batch_size, tcfg.seed)
        total = tcfg.epochs * self.schedule.steps_per_epoch
        self.total_steps = min(total, tcfg.max_steps) if tcfg.max_steps else total

    # -- actors -----------------------------------------------------------------------------
    def _start_actors(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tcfg = self.cfg.train
        resources = on_node(tcfg.node_resource)
        bundle = {"CPU": tcfg.actor_cpus, **({"GPU": tcfg.actor_gpus} if tcfg.actor_gpus else {}), **resources}
        opts = {"num_cpus": tcfg.actor_cpus, "num_gpus": tcfg.actor_gpus, "resources": resources}
        self.targets, self.drafters, self.groups = [], [], []
        for s in range(tcfg.num_streams):
            pg = placement_group([bundle] if tcfg.colocate else [bundle, bundle], strategy="STRICT_PACK")
            ray.get(pg.ready())
            self.groups.append(pg)

            def at(index: int, role: str) -> dict:
                return {**opts, "name": f"{self.run_name}-{role}-{s}", "scheduling_strategy":
                        PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}

            if tcfg.colocate:  # the stream's one actor is its target and its drafter
                self.drafters.append(ray.remote(ColocatedWorker).options(**at(0, "stream")).remote(
                    self.target, self.layer_ids, self.drafter_cfg_json, self.init, tcfg, s, tcfg.num_streams))
                continue
            self.targets.append(ray.remote(TargetWorker).options(**at(0, "target")).remote(
                self.target, self.layer_ids, tcfg))
            self.drafters.append(ray.remote(DrafterWorker).options(**at(1, "drafter")).remote(
                self.target, self.drafter_cfg_json, self.init, tcfg, s, tcfg.num_streams))
        # rank 0 hosts the group's store: its own node's address, a port free there (as Ray Train does)
        self.rendezvous = ray.get(self.drafters[0].__ray_call__.remote(_rendezvous))
        self.stream_nodes.update(ray.get([a.__ray_call__.remote(_node) for a in self.targets + self.drafters]))
        ray.get([d.init_group.remote(*self.rendezvous) for d in self.drafters])
        ray.get([d.set_total_steps.remote(self.total_steps) for d in self.drafters])

    def _stop_actors(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.targets + self.drafters:
            ray.kill(actor)
        for pg in self.groups:
            remove_placement_group(pg)
        self.targets, self.drafters, self.groups = [], [], []

    def _resume(self) -> None:
        """Continue from the newest checkpoint that verifies. The coordinator reads its manifest and
        `state.json` alone (the weights and optimizer state can be tens of GB): each drafter reads
        and checks those itself, and a checkpoint a drafter finds corrupt gives way to the one before.
        A checkpoint of another run (other training settings, data or target) is refused."""
        import logging

        import ray

        self.step, rejected = 0, []
        now = self.cfg.to_dict()["train"]
        for step in reversed(checkpoint.complete_steps(self.output)):
            try:
                files = checkpoint.verify(self.output, step)  # every file there, at its size
                state = json.loads(checkpoint.read_file(self.output, step, "state.json", files))
            except checkpoint.CorruptCheckpoint as e:
                rejected.append(f"step {step}: {e}")
                continue
            saved = state["config"]["train"]
            changed = [f"train.{k}" for k in sorted(now) if k not in OPERATIONAL and saved.get(k) != now[k]]
            changed += [f"{name} (checkpoint: {state.get(name)}, now: {value})"
                        for name, value in (("data", self.data), ("target", self.target)) if state.get(name) != value]
            if changed:
                raise DFlashError(f"the checkpoint was made with other settings ({', '.join(changed)} differ): "
                                  "resuming would not continue the same run", file=self.output)
            try:
                ray.get([d.load_checkpoint.remote(self.output, step) for d in self.drafters])
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, checkpoint.CorruptCheckpoint):
                    raise
                rejected.append(f"step {step}: {e.cause}")  # the drafter's own words, not its traceback
                continue
            if rejected:
                logging.getLogger(__name__).warning("resuming from step %d; newer checkpoints do not verify: %s",
                                                    step, "; ".join(rejected))
            self.step = step
            self.metrics = [m for m in state.get("metrics", []) if m["step"] <= self.step]  # row k: the k-th step, done
            return
        if rejected:
            raise DFlashError(f"no checkpoint verifies ({'; '.join(rejected)}): resuming would start over; delete "
                              "the checkpoints or choose another --output", file=self.output)

    # -- checkpoints ------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        import ray

        checkpoint.begin(self.output, self.step)  # a manifest of an earlier run at this step no longer counts
        entries = ray.get(self.drafters[0].write_checkpoint_files.remote(self.output, self.step))
        rngs = ray.get([d.rng_state.remote() for d in self.drafters])
        state = {"step": self.step, "total_steps": self.total_steps, "rng": [r.hex() for r in rngs],
                 "metrics": self.metrics, "config": self.cfg.to_dict(), "target": self.target, "data": self.data}
        entries["state.json"] = checkpoint.write_file(self.output, self.step, "state.json",
                                                      json.dumps(state).encode())
        checkpoint.commit(self.output, self.step, entries, {"step": self.step})
        checkpoint.rotate(self.output, self.cfg.train.keep_checkpoints, upto=self.step)
        storage.write_text(storage.join(self.output, "metrics.jsonl"),
                           "".join(json.dumps(m) + "\n" for m in self.metrics))
        self.trackers.sync()

    def _evaluate(self) -> float | None:
        """Simulated tau of drafter 0 on the held-out samples (features from target 0)."""
        import ray

        if not self.heldout:
            return None
        bs = self.cfg.train.batch_size
        batches = [self.heldout[i:i + bs] for i in range(0, len(self.heldout), bs)]
        if self.cfg.train.colocate:
            taus = ray.get([self.drafters[0].evaluate_samples.remote(b) for b in batches])
        else:
            taus = ray.get([self.drafters[0].evaluate.remote(self.targets[0].features.remote(b)) for b in batches])
        flat = [t for part in taus for t in part]
        return sum(flat) / len(flat) if flat else None

    # -- the loop ---------------------------------------------------------------------------
    def _record(self, stats: list[dict[str, float]], wait_s: float, step_s: float) -> None:
        tokens = sum(s["tokens"] for s in stats)
        row = {"step": self.step, "loss": stats[0]["loss"], "lr": stats[0]["lr"],
               "grad_norm": stats[0]["grad_norm"], "tau": sum(s["tau"] for s in stats) / len(stats),
               "acc_k1": sum(s["acc_k1"] for s in stats) / len(stats),
               "target_seconds": max(s["target_seconds"] for s in stats),
               "drafter_seconds": max(s["drafter_seconds"] for s in stats), "wait_seconds": wait_s,
               "step_seconds": step_s, "tokens_per_s": tokens / max(step_s, 1e-9)}
        self.metrics.append(row)
        for k, v in row.items():
            if k != "step":
                self._gauge(k).set(v)

    def _gauge(self, name: str):
        from ray.util.metrics import Gauge

        if name not in self._gauges:
            gauge = Gauge(f"dflash_train_{name}", description=f"training {name}", tag_keys=("run",))
            gauge.set_default_tags({"run": self.run_name})  # two runs on one cluster stay apart
            self._gauges[name] = gauge
        return self._gauges[name]

    def _train(self, stop_after_step: int | None) -> None:
        import ray

        tcfg = self.cfg.train
        ahead: list[dict[int, Any]] = [{} for _ in self.drafters]

        def submit(step: int) -> None:
            for s, target in enumerate(self.targets):
                if step < self.total_steps and step not in ahead[s]:
                    ahead[s][step] = target.features.remote(self.schedule.batch_for(step, s))

        while self.step < self.total_steps:
            start = time.perf_counter()
            if tcfg.colocate:  # each stream computes its own features in place
                wait_s = 0.0
                stats = ray.get([d.train_samples.remote(self.step, self.schedule.batch_for(self.step, s))
                                 for s, d in enumerate(self.drafters)])
            else:
                for k in range(tcfg.max_in_flight + 1):
                    submit(self.step + k)
                refs = [ahead[s].pop(self.step) for s in range(len(self.drafters))]
                ready_at = time.perf_counter()
                ray.wait(refs, num_returns=len(refs))
                wait_s = time.perf_counter() - ready_at
                # each drafter resolves its own stream's features: they never pass through here
                stats = ray.get([d.train_step.remote(self.step, ref) for d, ref in zip(self.drafters, refs)])
            self.step += 1
            self._record(stats, wait_s, time.perf_counter() - start)
            if tcfg.eval_every and (self.step % tcfg.eval_every == 0 or self.step == self.total_steps):
                self.metrics[-1]["heldout_tau"] = self._evaluate()
                if self.metrics[-1]["heldout_tau"] is not None:
                    self._gauge("heldout_tau").set(self.metrics[-1]["heldout_tau"])
            self.trackers.log(self.step, self.metrics[-1])
            if self.step % tcfg.checkpoint_every == 0 or self.step == self.total_steps:
                self._checkpoint()
            if stop_after_step is not None and self.step >= stop_after_step:
                if self.step % tcfg.checkpoint_every:
                    self._checkpoint()
                return

    def run(self, stop_after_step: int | None = None) -> dict[str, Any]:
        import ray
        from ray.exceptions import RayActorError

        started = time.perf_counter()
        self._plan()
        tracked = self.trackers.start(self.run_name, self.cfg.to_dict())
        try:
            while True:
                self._start_actors()
                try:
                    self._resume()
                    self._train(stop_after_step)
                    break
                except RayActorError as e:
                    self.restarts += 1
                    if self.restarts > self.cfg.train.max_restarts:
                        raise DFlashError(f"an actor died {self.restarts} times, over the budget of "
                                          f"{self.cfg.train.max_restarts} restarts; last: {e}") from None
                finally:
                    self._stop_actors()
        finally:
            self.trackers.finish()
        last = self.metrics[-1] if self.metrics else {}
        heldout = [m for m in self.metrics if m.get("heldout_tau") is not None]
        return {"stage": "train", "output": self.output, "step": self.step, "total_steps": self.total_steps,
                "restarts": self.restarts, "loss": last.get("loss"), "tau": last.get("tau"),
                "rendezvous": f"{self.rendezvous[0]}:{self.rendezvous[1]}" if self.rendezvous else None,
                "coordinator_node": ray.util.get_node_ip_address(), "stream_nodes": sorted(self.stream_nodes),
                "heldout_tau": heldout[-1]["heldout_tau"] if heldout else None,
                "heldout_tau_first": heldout[0]["heldout_tau"] if heldout else None,
                "seconds": round(time.perf_counter() - started, 1), "trackers": tracked,
                "checkpoint": checkpoint.step_dir(self.output, self.step)}

    def progress(self) -> dict[str, Any]:
        return {"step": self.step, "total_steps": self.total_steps, "restarts": self.restarts,
                "last": self.metrics[-1] if self.metrics else None}


def plot_metrics(metrics: list[dict[str, Any]]) -> bytes:
    from dflash_ray.plots import COLOR, png_figure

    steps = [m["step"] for m in metrics]
    with png_figure(3, (12, 3.2)) as (_, axes, buf):
        for ax, key, title in zip(axes, ("loss", "tau", "tokens_per_s"),
                                  ("loss", "simulated acceptance length", "tokens/s")):
            ax.plot(steps, [m[key] for m in metrics], color=COLOR, label="train batches")
            ax.set_title(title)
            ax.set_xlabel("step")
        held = [m for m in metrics if m.get("heldout_tau") is not None]
        if held:
            axes[1].plot([m["step"] for m in held], [m["heldout_tau"] for m in held], "o-", color="#c0504d",
                         label="held-out")
            axes[1].legend()
    return buf.getvalue()


def run_train(target: str, data: str, output: str, cfg: RunConfig, *, stop_after_step: int | None = None,
              progress: bool = True, run_name: str | None = None) -> dict[str, Any]:
    """Train, resuming from the newest complete checkpoint in `output` when there is one.
    `stop_after_step` ends the run (with a checkpoint) after that step, to train in slices."""
    import uuid

    import ray
    from tqdm import tqdm

    from dflash_ray.cluster import connect

    from dflash_ray.registry import pin

    check_installed(cfg.train.trackers)
    target = pin(target)  # a Hub id: the commit every stream actor loads, recorded in the checkpoints
    drafter_cfg, init = drafter_config(target, cfg), drafter_init(target, cfg)  # bad settings fail here
    check_mask_row(target, drafter_cfg)
    connect(cfg.ray)
    run_name = run_name or f"dflash-train-{uuid.uuid4().hex[:8]}"
    coordinator = ray.remote(Coordinator).options(num_cpus=0, max_concurrency=2,
                                                  resources=on_node(cfg.ray.head_resource)).remote(
        target, data, output, cfg, run_name, drafter_cfg, init, driver_env())
    run_ref = coordinator.run.remote(stop_after_step)
    bar = None
    try:
        while not ray.wait([run_ref], timeout=2.0)[0]:
            state = ray.get(coordinator.progress.remote())
            if state["total_steps"] is None:  # still planning
                continue
            if bar is None:
                bar = tqdm(total=state["total_steps"], desc="train", unit=" steps", disable=not progress)
            bar.n = state["step"]
            if state["last"]:
                bar.set_postfix(loss=f"{state['last']['loss']:.3f}", tau=f"{state['last']['tau']:.2f}")
            bar.refresh()
        summary = ray.get(run_ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.as_instanceof_cause()
        if isinstance(cause, DFlashError):
            raise cause from None
        raise
    finally:
        if bar is not None:
            bar.close()
        ray.kill(coordinator)
    metrics_uri = storage.join(output, "metrics.jsonl")
    if storage.exists(metrics_uri):
        metrics = [json.loads(x) for x in storage.read_text(metrics_uri).splitlines() if x.strip()]
        if metrics:
            storage.write_bytes(storage.join(output, "metrics.png"), plot_metrics(metrics))
            summary["metrics_png"] = storage.join(output, "metrics.png")
    return summary
