"""One training step captured as a CUDA graph and replayed: on a GPU, a small model's step is mostly the host launching
hundreds of kernels one by one while the GPU waits (the ResNet at batch 512 on one H100: 497 kernels, the GPU idle
two thirds of the step). A graph launches the whole step, forward, backward, clip and optimizer, in one call: that
step in bf16 took 8.27 ms instead of 11.26 (benchmarks/BENCHMARKS.md, "The training step as a CUDA graph").

The step is any function of the batch's tensors that returns tensors (or None), with no host sync (`.item()`, a Python
`if` on a tensor, a blocking copy): torch refuses those inside a capture. The first WARMUP calls run it eagerly (real
steps, on a side stream as torch's docs ask, so that lazy set-up such as the optimizer's momentum buffers happens
outside the capture); the next call captures it once, with the batch copied into fixed input tensors and the learning
rate moved into a tensor on the device that `set_lr` overwrites; every later call copies the batch in and replays.
Anywhere else (a CPU, several processes, gradient accumulation, fp16's loss scaler, --compile, --no-cuda_graph, an
optimizer that is not capturable, or a reason the recipe gives) the step runs eagerly, the same operations as a loop
without this file. A capture that fails says so in one line and the run goes on eagerly.
https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs
"""

import torch

WARMUP = 3  # eager steps before the capture (torch's example uses 3)


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
            self.eager_because = f"its capture failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            print(f"warning: the training step runs without a CUDA graph: {self.eager_because}", flush=True)
            for group, lr in zip(self.optimizer.param_groups, floats, strict=True):
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            return self.function(*batch)
        self.graph = graph
        return self(*batch)
