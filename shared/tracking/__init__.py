"""What a run records, one job per module:

- folder.py: `open_run` picks the run's folder (the same on every process; a new, empty or resumable one) and builds
  the Accelerator's `log_with`: the user's tracker plus `RunFiles`;
- trackers.py: wandb (offline without an API key) and TensorBoard as accelerate's trackers, and `run_config`, what
  config.json and the tracker record;
- run_files.py: `RunFiles`, files readable without any service: config.json (at init_trackers), metrics.jsonl (one
  line per accelerator.log), summary.json (the last value of every key, like wandb's run summary) and curves.png (at
  end_training);
- pictures.py: curves.png and the confusion matrix, with matplotlib (an opt-in module: imported where one is drawn);
- window.py: `TrainWindow` measures training between log points, and the run's time across its pieces.
"""

from shared.tracking.folder import open_run
from shared.tracking.trackers import run_config
from shared.tracking.window import TrainWindow

__all__ = ["TrainWindow", "open_run", "run_config", "save_pictures"]  # what the recipes use


def save_pictures(accelerator, run_dir, test_set, predictions, step: int) -> None:
    """confusion_matrix.png in the run folder, and as an image in wandb or TensorBoard (pictures.py)."""
    from shared.tracking import pictures  # matplotlib: an opt-in module

    pictures.save_pictures(accelerator, run_dir, test_set, predictions, step)
