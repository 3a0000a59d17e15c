"""accelerate's TensorBoard tracker for --tracker tensorboard: an opt-in module, imported by shared/tracking.py's
open_run for the runs that ask for it."""

from accelerate.tracking import TensorBoardTracker, on_main_process

from shared.pictures import is_point


class TensorBoard(TensorBoardTracker):
    """accelerate's TensorBoard tracker, one run and one history per run folder: the flags go into the run's own
    event file (add_hparams writes them as a second run, pytorch#32651); a resume hides the events logged after its
    checkpoint (a branch's abandoned points, a piece killed after its checkpoint) with SummaryWriter's purge_step;
    the summary's one-point scalars stay in summary.json."""

    def start(self):  # the writer comes with the run's configuration (below): after RunFiles' config.json, see open_run
        pass

    @on_main_process
    def store_init_configuration(self, values: dict):
        from torch.utils.tensorboard.summary import hparams

        if values.get("resumed_step") is not None:
            self.init_kwargs["purge_step"] = values["resumed_step"] + 1
        super().start()  # accelerate's: SummaryWriter(<run>/tensorboard, **init_kwargs)
        flags = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        for summary in hparams(flags, {}):  # hparams take numbers, strings and booleans only
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        if is_point(values):  # the summary stays in summary.json: one point a key
            super().log(values, step=step, **kwargs)
