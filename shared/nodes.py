"""What only a run of several machines needs: an opt-in module, imported by shared/tracking.py's open_run when the
processes are on more than one machine."""

import uuid
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

from shared.errors import RecipeError


def check_shared(run_dir: Path, checkpoint_dir: str | None) -> None:
    """Refuse a run folder, or a --checkpoint_dir, that the nodes do not share (a file the main process writes must be
    seen by all), since only the main process writes the run's files and completes its checkpoints."""
    check_folder(run_dir, "--output_dir")
    if checkpoint_dir:
        check_folder(Path(checkpoint_dir), "--checkpoint_dir")


def check_folder(folder: Path, flag: str) -> None:
    state = PartialState()
    token, check = [uuid.uuid4().hex], folder / ".shared_check"
    broadcast_object_list(token)
    if state.is_main_process:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            check.write_text(token[0])
        except OSError as error:
            raise RecipeError(f"cannot write to {flag} {folder} ({error.strerror}): pass a writable folder") from None
    state.wait_for_everyone()
    seen = gather_object([check.is_file() and check.read_text() == token[0]])
    if state.is_main_process:
        check.unlink()
    if not all(seen):
        raise RecipeError(f"{flag} {folder} is not one folder shared by every node ({seen.count(False)} "
                          "process(es) do not see the main process's files): put it on a filesystem all nodes mount")
