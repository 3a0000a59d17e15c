"""What a training loop uses around its step, each a function of the step or the device:

- the learning rate as a function of the optimizer step (`one_cycle_lr`; the --ema average's update, one too, is
  shared/ema.py's, an opt-in module). A stateful scheduler saved in a checkpoint keeps the length it was built for
  (OneCycleLR fails at step 41 of a 40-step run resumed with --max_steps 50); a function of (step, total_steps, peak)
  has no state to go stale, so a resumed run can be given another length.
- the step captured as a CUDA graph and replayed (`CapturedStep`): on a GPU, a small model's step is mostly the host
  launching hundreds of kernels one by one while the GPU waits (the ResNet at batch 512 on one H100: 497 kernels, the
  GPU idle two thirds of the step). A graph launches the whole step, forward, backward, clip and optimizer, in one
  call: that step in bf16 took 8.27 ms instead of 11.26 (benchmarks/BENCHMARKS.md, "The training step as a CUDA
  graph"). The step is any function of the batch's tensors that returns tensors (or None), with no host sync
  (`.item()`, a Python `if` on a tensor, a blocking copy): torch refuses those inside a capture. The first WARMUP
  calls run it eagerly (real steps, on a side stream as torch's docs ask, so that lazy set-up such as the optimizer's
  momentum buffers happens outside the capture); the next call captures it once, with the batch copied into fixed
  input tensors and the learning rate moved into a tensor on the device that `set_lr` overwrites; every later call
  copies the batch in and replays. Anywhere else (a CPU, several processes, gradient accumulation, fp16's loss
  scaler, --compile, --no-cuda_graph, an optimizer that is not capturable, or a reason the recipe gives) the step
  runs eagerly, the same operations as a loop without it. A capture that fails says so in one line and the run goes
  on eagerly. https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs
- the process's settings that make a step faster on its device, each measured there (benchmarks/BENCHMARKS.md,
  `device_settings`, `data_on_device`): on a CPU, glibc keeping the memory a step frees for the next step; on a GPU,
  TF32, the uint8 dataset held in GPU memory, and cuDNN's autotuning when --cudnn_benchmark asks for it.
"""

import ctypes
import sys

import torch

from shared.errors import first_line

# What config.json records and a resume with another length prints.
SCHEDULE_RULE = ("one-cycle over total_steps; resumed with another length, it is rebuilt for the new total_steps "
                 "and continues at the resumed step (each later step uses the rate a run of the new length would)")
WARMUP = 3  # eager steps before the capture (torch's example uses 3)
# mallopt's parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1  # free memory at the heap's top kept instead of trimmed (default 128 KiB)
M_MMAP_THRESHOLD = -3  # blocks at least this big get their own mapping, returned to the kernel when freed (128 KiB)
KEEP_FREED_BYTES = 1 << 30  # both raised to 1 GiB: a step's activations reuse the last step's memory


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


def graph_setting(accelerator, cfg) -> str | None:
    """Why this run's step runs eagerly, or None if it can be captured."""
    reasons = {"not on a GPU": accelerator.device.type != "cuda", "--no-cuda_graph": not cfg.cuda_graph,
               "several processes (DDP's gradient hooks)": accelerator.num_processes > 1,
               "--grad_accum above 1": cfg.grad_accum > 1, "fp16 (its loss scaler reads the gradient)":
               accelerator.mixed_precision == "fp16", "--compile": cfg.compile}
    return next((reason for reason, found in reasons.items() if found), None)


class CapturedStep:
    """`step(*batch)` with the semantics of `function(*batch)`: eager until captured, then replayed (module docstring).
    `eager_because` says why it is never captured (None: it will be)."""

    def __init__(self, function, optimizer, eager_because: str | None):
        if eager_because is None and not all(group.get("capturable", True) for group in optimizer.param_groups):
            eager_because = "the optimizer is not capturable (torch's Adam: capturable=False)"
        self.function, self.optimizer, self.eager_because = function, optimizer, eager_because
        self.calls, self.graph = 0, None

    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group for the next step: once captured, written into the tensor the
        graph reads; before, a number (also over a tensor a checkpoint of a captured run brought back)."""
        for group in self.optimizer.param_groups:
            if self.graph is not None:
                group["lr"].fill_(lr)  # a kernel on the stream, in order with the replays: no sync
            else:
                group["lr"] = lr

    def __call__(self, *batch):
        if self.graph is not None:
            for static, tensor in zip(self.inputs, batch, strict=True):
                static.copy_(tensor)
            self.graph.replay()
            # Copies: the next replay overwrites the outputs, and the caller keeps them (the window's sums).
            return tuple(None if out is None else out.clone() for out in self.outputs)
        if self.eager_because is not None:
            return self.function(*batch)
        self.calls += 1
        if self.calls <= WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                outputs = self.function(*batch)
            torch.cuda.current_stream().wait_stream(side)
            return outputs
        return self._capture(batch)

    def _capture(self, batch):
        device = batch[0].device
        self.inputs = [tensor.clone() for tensor in batch]
        self.optimizer.zero_grad(set_to_none=True)  # the gradients are then made inside the graph's own memory
        floats = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), device=device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.outputs = self.function(*self.inputs)
        except Exception as error:  # noqa: BLE001 (any failure: the eager step still trains the same model)
            self.eager_because = f"its capture failed ({type(error).__name__}: {first_line(error)[:200]})"
            print(f"warning: the training step runs without a CUDA graph: {self.eager_because}")
            for group, lr in zip(self.optimizer.param_groups, floats, strict=True):
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            return self.function(*batch)
        self.graph = graph
        return self(*batch)


def keep_freed_memory() -> bool:
    """Keep freed memory in the process instead of handing it back to the kernel (glibc on Linux). By default every
    block over 128 KiB is returned when freed, so each step's activations come back as fresh pages the kernel faults
    in and zeroes: up to a quarter of a CPU step (benchmarks/BENCHMARKS.md, "The allocator"). The same as setting
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ before the launch (measured equal there). True if glibc took
    both settings; False elsewhere (macOS, musl), where nothing changes."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform == "linux" else None  # musl has none
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(parameter, KEEP_FREED_BYTES) == 1 for parameter in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))


def device_settings(accelerator, cfg) -> None:
    """What the run's device gains from, set for this process. On a CPU, keep_freed_memory() (shared/launch.py's
    check_cpu says where a GPU was meant, or bf16 would be emulated). On a GPU, TF32 runs float32 matmuls and
    convolutions on the tensor cores with a 10-bit mantissa: the ResNet's float32 steps 2.9x faster than with neither
    in TF32 (one H100; torch's own default is TF32 for convolutions only); --no-tf32 for full float32.
    --cudnn_benchmark times cuDNN's algorithms for each new shape and keeps the fastest: steps 1.26-1.47x faster (the
    ResNet in bf16 at batch 512), but its 702-step run took 12.2 s with it against 10.2 s without (19.1 s in the first
    process on a fresh machine). Off by default: by these figures it pays beyond about 1,400 steps. BENCHMARKS.md,
    "GPU speed"."""
    device = accelerator.device
    if cfg.compile:
        # model.compile() of a model whose forward is torch's own (an nn.Sequential: cifar_cnn's) compiled nothing on
        # torch 2.11, silently (pytorch #150915; fixed later by pytorch #185722), and of the ResNet each block apart:
        # with its top frame wrapped, each model is one graph, on every torch
        torch._dynamo.config.wrap_top_frame = True
    if device.type == "cpu":
        keep_freed_memory()
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        # The legacy flags, not fp32_precision: mixing the two APIs makes a later read of allow_tf32 raise.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32


def data_on_device(device: torch.device, wanted: bool | None, *splits) -> bool:
    """Whether to hold the uint8 splits in the device's memory: --data_on_device or --no-data_on_device, and by
    default on a GPU when they take at most a quarter of its free memory (one H100, the ResNet in bf16 at batch 512:
    1.35-1.59x samples/s against a host-to-GPU copy per batch). Fashion-MNIST takes 55 MB, CIFAR-10 184 MB."""
    if wanted is not None or device.type != "cuda":
        return bool(wanted)
    size = sum(split.images.nbytes + split.labels.nbytes for split in splits)
    return size <= torch.cuda.mem_get_info(device)[0] / 4
