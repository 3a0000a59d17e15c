"""wandb and TensorBoard as accelerate's trackers, and what config.json and the tracker record (`run_config`)."""

import dataclasses
import netrc
import os
import platform
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import torch
from accelerate.tracking import TensorBoardTracker, WandBTracker, on_main_process

from shared.errors import RecipeError, first_line
from shared.schedule import SCHEDULE_RULE
from shared.tracking.run_files import is_point


class WandB(WandBTracker):
    """accelerate's wandb tracker, offline without an API key, with the optimizer step as every chart's x-axis.

    The step travels as a logged value ("step", the x-axis by define_metric), not as wandb's own step counter: a
    resumed run logs again the steps after its checkpoint, and wandb drops points whose own step goes backwards."""

    def __init__(self, project: str, run_dir: Path, run_id: str, tags: list[str]):
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else None)
        if mode not in (None, "online", "offline", "disabled", "dryrun", "run", "shared"):  # wandb's own choices
            raise RecipeError(f"the environment sets WANDB_MODE={mode!r}: wandb takes online, offline or disabled "
                              "(or --tracker tensorboard or none)")
        if mode is None:  # `wandb login` writes the key into ~/.netrc
            host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
            try:
                mode = "online" if netrc.netrc().authenticators(host) else "offline"
            except (OSError, netrc.NetrcParseError):
                mode = "offline"
        import wandb

        # silent: wandb's own dozen lines at the start and a table at the end; where the run is, said once in start().
        # Online but unreachable, wandb waited 90 s before start() could fall back to offline: 10 s, unless set.
        timeout = {} if "WANDB_INIT_TIMEOUT" in os.environ else {"init_timeout": 10}
        super().__init__(project, dir=str(run_dir), id=run_id, resume="allow", mode=mode, tags=tags,
                         settings=wandb.Settings(silent=True, **timeout))

    @on_main_process
    def start(self):
        try:
            super().start()
        except Exception as error:  # no network, server down, bad key: training matters more than the dashboard
            if self.init_kwargs["mode"] != "online":
                raise
            print(f"warning: wandb could not start online ({type(error).__name__}: {first_line(error)[:150]}); "
                  "logging offline instead, upload later with `wandb sync`", file=sys.stderr, flush=True)
            import wandb

            wandb.teardown()  # the failed attempt still holds the run id in wandb's background service
            self.init_kwargs["mode"] = "offline"
            super().start()
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        where = self.run.url if self.init_kwargs["mode"] == "online" else (
            f"offline, in {Path(self.run.dir).parent}; upload it later with: wandb sync {Path(self.run.dir).parent}")
        print(f"wandb: {where}", flush=True)

    @on_main_process
    def store_init_configuration(self, values: dict):
        # Named from the configuration the run records: its launch, precision and global batch.
        self.run.name = (f"{values['recipe']}-{values['world_size']}x{values['mixed_precision']}"
                         f"-b{values['global_batch_size']}{'-synthetic' if values.get('synthetic') else ''}"
                         f"-{time.strftime('%m%d-%H%M')}")
        super().store_init_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log({**values, "step": step}, **kwargs)


class TensorBoard(TensorBoardTracker):
    """accelerate's TensorBoard tracker, one run and one history per run folder: the flags go into the run's own
    event file (add_hparams writes them as a second run, pytorch#32651); a resume hides the events logged after its
    checkpoint (a branch's abandoned points, a piece killed after its checkpoint) with SummaryWriter's purge_step;
    the summary's one-point scalars stay in summary.json."""

    @on_main_process
    def store_init_configuration(self, values: dict):
        from torch.utils.tensorboard.summary import hparams

        if values.get("resumed_step") is not None:
            self.writer.close()
            self.writer = type(self.writer)(self.logging_dir, purge_step=values["resumed_step"] + 1)
        flags = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        for summary in hparams(flags, {}):  # hparams take numbers, strings and booleans only
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        if is_point(values):  # the summary stays in summary.json: one point a key
            super().log(values, step=step, **kwargs)


def run_config(cfg, accelerator, run_dir: Path, **extra) -> dict:
    """What config.json and the tracker record: every flag, the run folder, the launch and the versions."""
    import accelerate

    return {**dataclasses.asdict(cfg), "output_dir": str(run_dir), **extra, "lr_schedule": SCHEDULE_RULE,
            "world_size": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
            "distributed_type": accelerator.distributed_type.value, "device": str(accelerator.device),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "accelerate": accelerate.__version__,  # datasets: None when this run's data needed none
                         "datasets": getattr(sys.modules.get("datasets"), "__version__", None)}}
