"""--ema: an average of the weights, updated after every optimizer step as a function of the step. An opt-in module,
imported by each recipe's train() for the runs that pass --ema."""

import weakref

import torch

# Each --ema average's tensors, paired with its model's, found once: walking a ResNet-18's modules for its 127 tensors
# took 0.3-0.6 ms a step, a few percent of a step on a GPU. Checkpoint loads and .to() update the same tensors in place.
EMA_TENSORS = weakref.WeakKeyDictionary()  # average -> (model, float tensors of each, integer tensors of each)


@torch.no_grad()  # an in-place update of the average, outside autograd
def update_ema(average: torch.nn.Module, model: torch.nn.Module, step: int, decay: float) -> None:
    """--ema after optimizer step `step` (0-based): every parameter and floating-point buffer (BatchNorm's running
    statistics) of `average` moves to `weight * average + (1 - weight) * model`, with the decay ramped up as timm's
    does, weight = min(decay, (1 + step) / (10 + step)) (0.18, 0.25, 0.31, ... 0.9 after 80 steps), and a copy at
    step 0. A fixed decay of 0.99 still holds 1/e of the first, random weights after 100 steps: short runs averaged
    to chance. The weight is a Python number taken from the step, so the update reads nothing from the device, and
    one foreach lerp updates every tensor at once: a few kernels, where torch's AveragedModel made one blocking copy
    of its update count to the device per parameter, and several kernels per parameter."""
    weight = min(decay, (1 + step) / (10 + step)) if step else 0.0
    found = EMA_TENSORS.get(average)
    if found is None or found[0] is not model:
        pairs = list(zip([*average.parameters(), *average.buffers()], [*model.parameters(), *model.buffers()],
                         strict=True))
        floats = [[*tensors] for tensors in zip(*[pair for pair in pairs if pair[0].is_floating_point()])]
        counts = [[*tensors] for tensors in zip(*[pair for pair in pairs if not pair[0].is_floating_point()])]
        found = EMA_TENSORS[average] = (model, floats, counts)  # counts: BatchNorm's num_batches_tracked, copied
    _, floats, counts = found
    torch._foreach_lerp_(*floats, 1 - weight)  # average + (1 - weight) * (model - average)
    if counts:
        torch._foreach_copy_(*counts)
