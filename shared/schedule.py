"""The learning rate, and the --ema average's decay, as functions of the optimizer step. A stateful scheduler saved
in a checkpoint keeps the length it was built for (OneCycleLR fails at step 41 of a 40-step run resumed with
--max_steps 50); a function of (step, total_steps, peak) has no state to go stale, so a resumed run can be given
another length."""

import torch

# What config.json records and a resume with another length prints.
SCHEDULE_RULE = ("one-cycle over total_steps; resumed with another length, it is rebuilt for the new total_steps "
                 "and continues at the resumed step (each later step uses the rate a run of the new length would)")


def one_cycle_lr(step: int, total_steps: int, peak: float) -> float:
    """The rate of optimizer step `step` (0-based): up from peak/25 to `peak` over the first 20% of the steps, then
    down to peak/250,000 at the last one. The same numbers as torch's OneCycleLR(pct_start=0.2,
    anneal_strategy="linear"), also for the 5-step run where OneCycleLR divides by zero."""
    start, end = peak / 25, peak / 25 / 1e4
    top = 0.2 * total_steps - 1  # the step at the peak, where OneCycleLR puts it (fractional)
    if step < top:  # written as OneCycleLR computes it, so that the floats come out the same
        pct = step / top
        return (peak - start) * pct + start
    pct = (step - top) / (total_steps - 1 - top)
    return (end - peak) * pct + peak


def ema_average(decay: float):
    """The `avg_fn` of torch's AveragedModel for --ema: an exponential moving average whose decay ramps up as timm's
    does, min(decay, (1 + n) / (10 + n)) at the n-th update (0.18, 0.25, 0.31, ... 0.9 after 80 steps). A fixed decay
    of 0.99 still holds 1/e of the first, random weights after 100 steps: short runs averaged to chance."""

    def average(averaged: torch.Tensor, current: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
        weight = ((1 + updates) / (10 + updates)).clamp(max=decay)  # a tensor: no host sync per step on a GPU
        return weight * averaged + (1 - weight) * current

    return average
