"""vLLM speculators' own `speculators train`, run by `bench.peers` in the peers' virtualenv.

Its trainer assumes an accelerator; on a host with none, four attributes are set at runtime, in
this process only (its installed files untouched):
- its step timer's `torch.accelerator.synchronize()` does nothing (a CPU has nothing in flight);
- a resume loads onto the CPU, not "cuda:0";
- the model and each batch go to the CPU, not `.to(0)` (accelerator 0);
- autocast runs on the CPU (it falls back to "cuda", where it would be silently off: fp32 training).

And on any host: `--max-steps` steps exactly (its loop leaves only the current epoch at that step;
the epochs are set to the fewest that hold them), and with METRICS_JSONL=FILE each metric record
its trainer logs (a step's loss and times, an epoch's validation) is appended to FILE as a JSON line.

    METRICS_JSONL=m.jsonl .peers-venv-speculators/bin/python -P bench/speculators_cpu.py ARGS...
"""

import json
import logging
import math
import os
import sys
import time

import torch
from speculators.train import checkpointer, cli, trainer
from speculators.train.config import TrainConfig

ON_CPU = not torch.accelerator.is_available()


class Trainer(trainer.Trainer):
    def setup_trainer(self):
        # the first call of their __init__ that follows the loaders, before the model moves
        if self.config.max_steps:
            epochs = math.ceil(self.config.max_steps / len(self.train_loader))
            self.config = self.config._replace(num_epochs=epochs)
        if ON_CPU:
            self.local_rank = torch.device("cpu")
            self.device_type = "cpu"
        super().setup_trainer()


class JsonLines(logging.Handler):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record):
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            with open(self.path, "a") as f:
                f.write(json.dumps({"time": time.time(), **record.msg}, default=float) + "\n")


def with_json_lines(setup, path: str):
    def setup_then_add(*args, **kwargs):
        setup(*args, **kwargs)  # their logging config resets the metrics logger's handlers
        logging.getLogger("speculators.metrics").addHandler(JsonLines(path))

    return setup_then_add


if __name__ == "__main__":
    if ON_CPU:
        torch.accelerator.synchronize = lambda *args, **kwargs: None
        checkpointer.get_current_device = lambda: "cpu"
    cli.Trainer = Trainer  # their main() builds the trainer from its module's globals
    if os.environ.get("METRICS_JSONL"):
        cli.setup_metric_logger = with_json_lines(cli.setup_metric_logger, os.environ["METRICS_JSONL"])
    cli.main(TrainConfig.resolve(sys.argv[1:]))
