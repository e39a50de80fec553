"""Several drafters trained side by side on the same batches of one target worker (no Ray): the
production `train_step` for each, so a benchmark compares what differs between them and nothing else."""

from __future__ import annotations


def train_side_by_side(target, drafters: dict, schedule, steps: int, desc: str = "train") -> None:
    """`target`: a `TargetWorker`; `drafters`: name → `DrafterWorker`; `schedule`: one stream's."""
    from tqdm import tqdm

    for worker in drafters.values():
        worker.set_total_steps(steps)
    for step in tqdm(range(steps), desc=desc, unit="step"):
        batch = target.features(schedule.batch_for(step, 0))
        for worker in drafters.values():
            worker.train_step(step, batch)
