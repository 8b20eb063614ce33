"""Every step of a throughput run, timed: where a workload's wall time goes between the steps.

    python bench/trace_steps.py --model bench/models/llama-3.1-8b --load-format dummy \\
        [--num-prompts 256 --input-len 128 --output-len 1024] [engine options]

Runs the workload of ``kvik bench throughput`` (random prompts, EOS ignored, a warm-up of 64
short requests first) through ``LLM.generate`` with each ``EngineCore.step()`` and each
``OutputProcessor.process_outputs()`` timed, then prints the run's time split into the steps and
the output processing, the decode steps' percentiles and the slowest steps with the tokens they
carried. A step far above its neighbours that scheduled as many tokens is a pause of the host
(the 2026-12-03 trace of workload B on the H200 found two of 0.37-0.47 s mid-decoding, which a
full collection of Python's cyclic collector explains; docs/benchmarks.md). Works on any device;
the GPU's figures are the ones that matter.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvik import LLM
from kvik.bench.common import random_workload, warmup_workload
from kvik.bench.throughput import generate
from kvik.cli.engine_args import add_engine_arguments, engine_kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--num-warmup-prompts", type=int, default=64)
    parser.add_argument("--slowest", type=int, default=8, help="steps to list, slowest first")
    add_engine_arguments(parser)
    args = parser.parse_args()
    llm = LLM(**engine_kwargs(args))
    vocab = llm.config.model.vocab_size
    workload = random_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    if args.num_warmup_prompts:
        warmup = warmup_workload(args.num_warmup_prompts, args.input_len, vocab, args.seed, 32)
        generate(llm, warmup, ignore_eos=True, use_tqdm=False)

    steps: list[tuple[float, int]] = []  # (seconds, tokens the call scheduled)
    processing: list[float] = []
    engine, outputs = llm.engine, llm.output_processor
    step, process, schedule = engine.step, outputs.process_outputs, engine.scheduler.schedule
    scheduled = [0]

    def counted_schedule(*a, **kw):
        out = schedule(*a, **kw)
        scheduled[0] += out.total_num_scheduled_tokens
        return out

    def timed_step():
        scheduled[0] = 0
        start = time.perf_counter()
        result = step()
        steps.append((time.perf_counter() - start, scheduled[0]))
        return result

    def timed_process(batch):
        start = time.perf_counter()
        result = process(batch)
        processing.append(time.perf_counter() - start)
        return result

    engine.step, outputs.process_outputs = timed_step, timed_process
    engine.scheduler.schedule = counted_schedule
    start = time.perf_counter()
    produced = generate(llm, workload, ignore_eos=True, use_tqdm=False)
    elapsed = time.perf_counter() - start
    engine.step, outputs.process_outputs, engine.scheduler.schedule = step, process, schedule
    report(args, steps, processing, elapsed, sum(produced))


def report(args, steps, processing, elapsed, num_output) -> None:
    ms = [seconds * 1e3 for seconds, _ in steps]
    print(
        f"{args.num_prompts} x ({args.input_len} in, {args.output_len} out): {elapsed:.3f} s, "
        f"{num_output / elapsed:.1f} output tok/s; {len(steps)} steps took {sum(ms) / 1e3:.3f} s, "
        f"output processing {sum(processing):.3f} s, the rest {elapsed - sum(ms) / 1e3 - sum(processing):.3f} s"
    )
    # Decode steps: those that scheduled at most one token a request.
    decode = sorted(m for m, (_, tokens) in zip(ms, steps) if 0 < tokens <= args.num_prompts)
    if decode:
        pick = lambda q: decode[min(len(decode) - 1, int(q * len(decode)))]  # noqa: E731
        print(
            f"decode steps: {len(decode)}, median {statistics.median(decode):.2f} ms, p90 "
            f"{pick(0.9):.2f}, p99 {pick(0.99):.2f}, max {decode[-1]:.2f}"
        )
    order = sorted(range(len(ms)), key=lambda i: -ms[i])[: args.slowest]
    for i in order:
        around = ms[max(0, i - 3) : i] + ms[i + 1 : i + 4]
        usual = statistics.median(around) if around else float("nan")
        print(
            f"step {i}: {ms[i]:.1f} ms, {steps[i][1]} tokens scheduled (its neighbours' median "
            f"{usual:.1f} ms)"
        )


if __name__ == "__main__":
    main()
