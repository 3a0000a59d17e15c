"""Fault injection for the tests, not for the recipes.

Python imports `sitecustomize` at startup when this folder is on PYTHONPATH. With
FAULT_DISK_FULL_AT_STEP=N, every file written into the checkpoint of step N fails with ENOSPC,
exactly as the save would on a full disk; everything else writes normally.
With FAULT_OOM_ABOVE_BATCH=N (and FAULT_OOM_RANK=R: only on that process), a loss over more than
N samples in training raises the error PyTorch's CPU allocator raises when memory runs out.
With FAULT_OOM_SECOND_STEP_ABOVE_BATCH=N, the second training loss of a batch over N samples runs out of memory:
the step that first holds the optimizer's state.
With RECORD_TRAINING_LABELS=DIR, every training loss appends its batch's labels as one line to
DIR/rank<R>.txt: with a dataset whose labels are all different, the samples each process trained on.
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

_oom_above = os.environ.get("FAULT_OOM_ABOVE_BATCH")
if _oom_above:
    import torch
    import torch.nn.functional

    def _cross_entropy_or_oom(cross_entropy):
        def cross_entropy_or_oom(input, target, *args, **kwargs):
            rank = os.environ.get("FAULT_OOM_RANK")
            training = torch.is_grad_enabled()  # evaluation batches are left alone
            if training and len(target) > int(_oom_above) and rank in (None, os.environ.get("RANK", "0")):
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                                   f"memory: you tried to allocate {len(target) * 2**30} bytes. "
                                   "Error code 12 (Cannot allocate memory)")
            return cross_entropy(input, target, *args, **kwargs)
        return cross_entropy_or_oom

    torch.nn.functional.cross_entropy = _cross_entropy_or_oom(torch.nn.functional.cross_entropy)

_oom_second_above = os.environ.get("FAULT_OOM_SECOND_STEP_ABOVE_BATCH")
if _oom_second_above:
    import torch
    import torch.nn.functional

    _losses_by_batch = {}

    def _cross_entropy_or_late_oom(cross_entropy):
        def cross_entropy_or_oom(input, target, *args, **kwargs):
            # The second training loss of a batch size: the step that holds the optimizer's state too.
            if torch.is_grad_enabled():
                _losses_by_batch[len(target)] = _losses_by_batch.get(len(target), 0) + 1
                if _losses_by_batch[len(target)] == 2 and len(target) > int(_oom_second_above):
                    raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                                       "memory: you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate "
                                       "memory)")
            return cross_entropy(input, target, *args, **kwargs)
        return cross_entropy_or_oom

    torch.nn.functional.cross_entropy = _cross_entropy_or_late_oom(torch.nn.functional.cross_entropy)

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
