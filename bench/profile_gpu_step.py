"""Where a decode step's time goes on the GPU: wall time per step, GPU kernel time per step, and
the kernels that take it.

    python bench/profile_gpu_step.py --model bench/models/llama-3.1-8b --load-format dummy \
        [--batch-size 1] [--context 256] [--steps 20] [--prefills 0 --prefill-len 1024] \
        [engine options: --enforce-eager, ...]

Admits ``--batch-size`` requests of ``--context`` random prompt tokens, runs them into steady
decoding, times ``--steps`` calls of ``EngineCore.step()``, then profiles as many and prints the
CUDA kernels by total time (a graph replay's kernels are listed one by one). The gap between GPU
time and wall time per step is what the host costs where it is not hidden; the host's own time to
launch a step (prepare and enqueue) and collect()'s wait for the device tell which side bounds it
(on the H200, 2026-12-03: a mixed step of 64 decodes and a 192-token prompt, 9.3 ms of kernels,
took 16 ms to launch, the attention op running from Python between the PIECEWISE graphs).

With ``--prefills K``, every timed and profiled step also carries K new prompts of
``--prefill-len`` tokens (each asks one token, so it leaves after its prefill): the mixed steps of
a prefill-heavy run such as workload C (1000 x (1024 in, 128 out): at 512 sequences a step holds
~500 decodes and ~7 prompts of 1024 tokens). Keep batch + K within max_num_seqs and batch + K x
prefill-len within max_num_batched_tokens, or the prompts queue and the steps are not alike.
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
    parser.add_argument("--prefills", type=int, default=0, help="new prompts in every step")
    parser.add_argument("--prefill-len", type=int, default=1024)
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
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    added = 0

    def add_prefills() -> None:
        nonlocal added
        for _ in range(args.prefills):
            start = args.batch_size * args.context + added * args.prefill_len
            prompt = [(7919 * (start + j)) % vocab for j in range(args.prefill_len)]
            request = llm.input_processor.make_request(f"p{added}", prompt, one_token, 0, 0.0)
            engine.add_request(request)
            added += 1

    times, launches, waits = [], [], []
    launch = engine.executor.launch

    def timed_launch(scheduler_output):
        started = time.perf_counter()
        pending = launch(scheduler_output)
        launches.append(time.perf_counter() - started)
        collect = pending.collect

        def timed_collect():
            started = time.perf_counter()
            try:
                return collect()
            finally:
                waits.append(time.perf_counter() - started)

        pending.collect = timed_collect
        return pending

    engine.executor.launch = timed_launch
    for _ in range(args.steps):
        add_prefills()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    engine.executor.launch = launch
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            add_prefills()
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels) / args.steps
    step = statistics.median(times)
    runner = engine.runner.step_runner
    mixed = f" + {args.prefills} prompts of {args.prefill_len}" if args.prefills else ""
    print(
        f"batch {args.batch_size}, context {args.context}{mixed}: step {step * 1e3:.3f} ms wall "
        f"(median of {args.steps}), GPU kernels {gpu_us / 1e3:.3f} ms per step; "
        f"{args.batch_size / step:.1f} decode tok/s"
        f"{f', {(args.batch_size + args.prefills * args.prefill_len) / step:.1f} tok/s in all' if mixed else ''}; "
        f"step runner {runner.name}, "
        f"replays {getattr(runner, 'num_replays', 0)}"
    )
    # Host-bound steps show here: launching (preparing the inputs and enqueueing the forward
    # pass, sampling included) longer than the GPU's work, and collect() then waits for nothing.
    print(
        f"host: launching a step {statistics.median(launches) * 1e3:.3f} ms, collect() waiting "
        f"for the device {statistics.median(waits) * 1e3:.3f} ms (medians)"
    )
    if args.prefills:
        # Prompts still waiting mean the steps did not each take K of them.
        print(f"prompts added {added}, waiting at the end {engine.scheduler.stats.num_waiting}")
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"{'kernel':<90} {'us/step':>9} {'calls/step':>10}")
    for e in kernels[: args.top]:
        print(
            f"{e.key[:90]:<90} {e.self_device_time_total / args.steps:9.1f} "
            f"{e.count / args.steps:10.1f}"
        )


if __name__ == "__main__":
    main()
