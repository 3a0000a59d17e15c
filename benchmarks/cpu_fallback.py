"""bf16 on a CPU without bfloat16 instructions, imitated on one that has them: run this twice, once as is and once
limited to AVX2, and compare the two lines it prints (each a matmul probe and the cifar_cnn model step in float32,
float32 + channels_last and bf16 + channels_last, 3 rounds taking turns).

    python benchmarks/cpu_fallback.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_fallback.py
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recipes import cifar_cnn  # noqa: E402  (after the path setup)


def seconds(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def model_step(inputs, labels, channels_last: bool, bf16: bool):
    model = cifar_cnn.make_model(10)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    optimizer = cifar_cnn.make_optimizer(model, cifar_cnn.Config())

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss = cifar_cnn.loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no flag measures anything
    torch.manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
        gflops = 2 * 512**3 / seconds(lambda: a @ b, 5) / 1e9
        out[f"matmul 512 {str(dtype).removeprefix('torch.')} GFLOP/s"] = round(gflops, 1)
    inputs = cifar_cnn.preprocess(torch.randint(0, 256, (128, 3, 32, 32), dtype=torch.uint8), training=True)
    labels = torch.randint(0, 10, (128,))
    steps = {"float32": model_step(inputs, labels, False, False),
             "float32+channels_last": model_step(inputs, labels, True, False),
             "bf16+channels_last": model_step(inputs, labels, True, True)}
    rates = {name: [] for name in steps}
    for _ in range(3):  # rounds: every setting takes its turn
        for name, step in steps.items():
            rates[name].append(128 / seconds(step, 3))
    median = {name: statistics.median(values) for name, values in rates.items()}
    out.update({f"{name} samples/s": round(value) for name, value in median.items()})
    out["bf16+channels_last / float32"] = round(median["bf16+channels_last"] / median["float32"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
