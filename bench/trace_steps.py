"""Every step of a throughput run, timed: where a workload's wall time goes between the steps.

    python bench/trace_steps.py --model bench/models/llama-3.1-8b --load-format dummy \\
        [--num-prompts 256 --input-len 128 --output-len 1024] [engine options]

Runs the workload of ``kvik bench throughput`` (random prompts, EOS ignored, a warm-up of 64
short requests first) through ``LLM.generate`` with each ``EngineCore.step()`` and each
``OutputProcessor.process_outputs()`` timed, then prints the run's time split into the steps and
the output processing, the decode steps' percentiles and the slowest steps with the tokens they
carried. A step far above its neighbours that scheduled as many tokens is a pause of the host;
the run's full collections of Python's cyclic collector and its Triton compiles are listed with
the step they fell in, the usual two causes. (On the H200, 2026-12-03: full collections of
0.34-0.45 s mid-decoding, and a paged-attention variant compiled in the first mixed step, 0.66 s;
docs/benchmarks.md.) Works on any device; the GPU's figures are the ones that matter.
"""

from __future__ import annotations

import argparse
import gc
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
    bounds: list[tuple[float, float]] = []  # each step's (start, end) on perf_counter's clock
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
        end = time.perf_counter()
        steps.append((end - start, scheduled[0]))
        bounds.append((start, end))
        return result

    def timed_process(batch):
        start = time.perf_counter()
        result = process(batch)
        processing.append(time.perf_counter() - start)
        return result

    engine.step, outputs.process_outputs = timed_step, timed_process
    engine.scheduler.schedule = counted_schedule
    pauses = PauseLog(steps)
    start = time.perf_counter()
    with pauses:
        produced = generate(llm, workload, ignore_eos=True, use_tqdm=False)
    elapsed = time.perf_counter() - start
    engine.step, outputs.process_outputs, engine.scheduler.schedule = step, process, schedule
    report(args, steps, processing, elapsed, sum(produced))
    report_outside_steps(args, bounds, processing, start, start + elapsed)
    pauses.report()


class PauseLog:
    """Within its block: each full (generation 2) collection with its duration, and each Triton
    kernel compiled (an in-memory cache miss: a variant new to this process, even where the disk
    cache holds it), with the step they fell in (the number of steps finished before)."""

    def __init__(self, steps: list) -> None:
        self.steps = steps
        self.collections: list[tuple[int, float]] = []
        self.young: list[float] = []  # the durations of generation 0 and 1 collections
        self.compiles: list[tuple[int, str]] = []
        self._collection_start = 0.0

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._collection_start = time.perf_counter()
        elif info["generation"] == 2:
            self.collections.append((len(self.steps), time.perf_counter() - self._collection_start))
        else:
            self.young.append(time.perf_counter() - self._collection_start)

    def _on_compile(self, *args, **kwargs) -> bool:
        name = str(kwargs.get("repr") or kwargs.get("fn")).split("[")[0]
        self.compiles.append((len(self.steps), f"{name} {kwargs.get('key')}"))
        return False  # compile as usual: only listed

    def __enter__(self) -> PauseLog:
        gc.callbacks.append(self._on_collection)
        try:
            import triton
        except ImportError:
            self._knobs = None
        else:
            self._knobs = triton.knobs.runtime
            self._previous_hook = self._knobs.jit_cache_hook
            self._knobs.jit_cache_hook = self._on_compile
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_collection)
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._previous_hook

    def report(self) -> None:
        total = sum(seconds for _, seconds in self.collections) * 1e3
        print(f"full collections: {len(self.collections)}, {total:.1f} ms in all")
        young = sorted(self.young, reverse=True)
        print(
            f"young collections: {len(young)}, {sum(young) * 1e3:.1f} ms in all, the longest "
            + ", ".join(f"{seconds * 1e3:.2f}" for seconds in young[:3])
            + " ms"
        )
        for step, seconds in self.collections:
            if seconds > 0.01:
                print(f"  in step {step}: {seconds * 1e3:.1f} ms")
        print(f"Triton compiles: {len(self.compiles)}")
        for step, kernel in self.compiles:
            print(f"  in step {step}: {kernel[:400]}")


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


def report_outside_steps(args, bounds, processing, run_start, run_end) -> None:
    """Where "the rest" (the run's time in neither a step nor the output processing) lies: before
    the first step (the requests' validation and admission), between steps, after the last one
    (the results' assembly), and the widest gaps between two steps. (On the H200, 2026-12-04,
    workload A's rest was 75 ms of its 1.24 s, ~6%, where the CPU's was ~5 ms.)"""
    if not bounds:
        return
    gaps = [bounds[i + 1][0] - bounds[i][1] for i in range(len(bounds) - 1)]
    between = sum(gaps) - sum(processing)
    print(
        f"outside the steps: {(bounds[0][0] - run_start) * 1e3:.1f} ms before the first, "
        f"{between * 1e3:.1f} ms between them besides the output processing, "
        f"{(run_end - bounds[-1][1]) * 1e3:.1f} ms after the last"
    )
    for i in sorted(range(len(gaps)), key=lambda i: -gaps[i])[: min(3, args.slowest)]:
        print(f"  gap after step {i}: {gaps[i] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
