"""Where one engine step's time goes on the CPU: step times, then the torch profiler's table.

    python bench/profile_cpu_step.py [--dtype bfloat16] [--batch-size 1] [--steps 10]

Runs the default model (or --model) with greedy decoding, times prefill and decode steps of
``EngineCore.step()``, and prints the profiler's most expensive ops over ``--steps`` decode steps,
grouped by input shape (so each linear layer shows on its own line).
"""

from __future__ import annotations

import argparse
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from kvik import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3 * args.steps + 10, ignore_eos=True)
    for i in range(args.batch_size):
        prompt = [100 + (i * args.input_len + j) % 40000 for j in range(args.input_len)]
        engine.add_request(llm.input_processor.make_request(str(i), prompt, params, 0, 0.0))
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    decode = statistics.median(times)
    print(
        f"{args.dtype}, batch {args.batch_size}: prefill step {prefill * 1e3:.1f} ms, decode step "
        f"median {decode * 1e3:.1f} ms ({args.batch_size / decode:.1f} output tok/s)"
    )
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            engine.step()
    table = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=32
    )
    print(table)


if __name__ == "__main__":
    main()
