"""What a run records, one job per module:

- folder.py: `open_run` picks the run's folder (the same on every process; a new, empty or resumable one) and builds
  the Accelerator's `log_with`: the user's tracker plus `RunFiles`;
- trackers.py: wandb (offline without an API key) and TensorBoard as accelerate's trackers, and `run_config`, what
  config.json and the tracker record;
- run_files.py: `RunFiles`, files readable without any service: config.json (at init_trackers), metrics.jsonl (one
  line per accelerator.log), summary.json (the last value of every key, like wandb's run summary) and curves.png (at
  end_training); `save_pictures`, the confusion matrix;
- window.py: `TrainWindow` measures training between log points, and the run's time across its pieces.
"""

from shared.tracking.folder import open_run
from shared.tracking.run_files import save_pictures
from shared.tracking.trackers import run_config
from shared.tracking.window import TrainWindow

__all__ = ["TrainWindow", "open_run", "run_config", "save_pictures"]  # what the recipes use
