"""Where a decode step's time goes on the GPU: wall time per step, GPU kernel time per step, and
the kernels that take it.

    python bench/profile_gpu_step.py --model bench/models/llama-3.1-8b --load-format dummy \
        [--batch-size 1] [--context 256] [--steps 20] [engine options: --enforce-eager, ...]

Admits ``--batch-size`` requests of ``--context`` random prompt tokens, runs them into steady
decoding, times ``--steps`` calls of ``EngineCore.step()``, then profiles as many and prints the
CUDA kernels by total time (a graph replay's kernels are listed one by one). The gap between GPU
time and wall time per step is what the host costs where it is not hidden.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvik import LLM, SamplingParams
from kvik.cli.engine_args import add_engine_arguments, engine_kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    add_engine_arguments(parser)
    args = parser.parse_args()
    kwargs = engine_kwargs(args)
    if kwargs["max_model_len"] is None:
        kwargs["max_model_len"] = 4096
    llm = LLM(**kwargs)
    engine = llm.engine
    vocab = llm.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 20, ignore_eos=True)
    for i in range(args.batch_size):
        prompt = [(7919 * (i * args.context + j)) % vocab for j in range(args.context)]
        engine.add_request(llm.input_processor.make_request(str(i), prompt, params, 0, 0.0))
    while any(r.num_output_tokens < 3 for r in engine.scheduler.running) or not (
        engine.scheduler.running
    ):
        engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels) / args.steps
    step = statistics.median(times)
    runner = engine.runner.step_runner
    print(
        f"batch {args.batch_size}, context {args.context}: step {step * 1e3:.3f} ms wall "
        f"(median of {args.steps}), GPU kernels {gpu_us / 1e3:.3f} ms per step; "
        f"{args.batch_size / step:.1f} tok/s; step runner {runner.name}, "
        f"replays {getattr(runner, 'num_replays', 0)}"
    )
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"{'kernel':<90} {'us/step':>9} {'calls/step':>10}")
    for e in kernels[: args.top]:
        print(
            f"{e.key[:90]:<90} {e.self_device_time_total / args.steps:9.1f} "
            f"{e.count / args.steps:10.1f}"
        )


if __name__ == "__main__":
    main()
