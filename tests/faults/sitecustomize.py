"""Fault injection for the tests, not for the recipes.

Python imports `sitecustomize` at startup when this folder is on PYTHONPATH. With
FAULT_DISK_FULL_AT_STEP=N, every file written into the checkpoint of step N fails with ENOSPC,
exactly as the save would on a full disk; everything else writes normally.
With RECORD_TRAINING_LABELS=DIR, every training loss appends its batch's labels as one line to
DIR/rank<R>.txt: with a dataset whose labels are all different, the samples each process trained on.
With FAULT_SLOW_CONFIG_READ_S=S, every process but the main one waits S seconds before its first read of a
config.json, so that the main process runs ahead, as one may on a loaded machine.
With FAULT_ABORT_AT_EXIT_RANK=R, the process of rank R aborts (SIGABRT) as its interpreter exits, after its run: what
gloo's teardown race (pytorch#179291) does now and then.
"""

import errno
import os

_step = os.environ.get("FAULT_DISK_FULL_AT_STEP")
if _step:
    import safetensors.torch
    import torch

    def _failing(save):
        def save_or_fail(obj, path, *args, **kwargs):
            if f"partial_step_{_step}" in str(path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return save(obj, path, *args, **kwargs)
        return save_or_fail

    torch.save = _failing(torch.save)
    safetensors.torch.save_file = _failing(safetensors.torch.save_file)

_record_dir = os.environ.get("RECORD_TRAINING_LABELS")
if _record_dir:
    import torch
    import torch.nn.functional

    def _recording(cross_entropy):
        def cross_entropy_and_record(input, target, *args, **kwargs):
            if torch.is_grad_enabled():  # training, not evaluation
                with open(os.path.join(_record_dir, f"rank{os.environ.get('RANK', '0')}.txt"), "a") as f:
                    f.write(" ".join(map(str, target.tolist())) + "\n")
            return cross_entropy(input, target, *args, **kwargs)
        return cross_entropy_and_record

    torch.nn.functional.cross_entropy = _recording(torch.nn.functional.cross_entropy)

_slow = os.environ.get("FAULT_SLOW_CONFIG_READ_S")
if _slow and os.environ.get("RANK", "0") != "0":
    import pathlib
    import time

    _read_text, _waited = pathlib.Path.read_text, []

    def _read_text_late(self, *args, **kwargs):
        if self.name == "config.json" and not _waited:
            _waited.append(True)
            time.sleep(float(_slow))
        return _read_text(self, *args, **kwargs)

    pathlib.Path.read_text = _read_text_late

if os.environ.get("FAULT_ABORT_AT_EXIT_RANK", "none") == os.environ.get("RANK"):
    import atexit

    atexit.register(os.abort)
