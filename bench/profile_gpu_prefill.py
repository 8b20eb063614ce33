"""Where a prefill-heavy run's time goes on the GPU: prompts of ``--prompt-len`` tokens with one
output token each, so that (almost) every step is a prefill step of the scheduler's token budget.

    python bench/profile_gpu_prefill.py --model bench/models/llama-3.1-8b --load-format dummy \\
        [--num-prompts 64] [--prompt-len 1024] [engine options]

Runs the prompts once to warm up, times a second batch, profiles a third and prints prefill tokens
a second, the effective matrix FLOP/s (2 FLOPs a parameter and token) and the CUDA kernels by
total time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvik import LLM, SamplingParams
from kvik.bench.roofline import parameter_count
from kvik.cli.engine_args import add_engine_arguments, engine_kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--top", type=int, default=20)
    add_engine_arguments(parser)
    args = parser.parse_args()
    kwargs = engine_kwargs(args)
    llm = LLM(**kwargs)
    vocab = llm.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def batch(seed: int) -> list[dict]:
        return [
            {"prompt_token_ids": [(7919 * (seed + i * args.prompt_len + j)) % vocab
                                  for j in range(args.prompt_len)]}
            for i in range(args.num_prompts)
        ]  # fmt: skip

    llm.generate(batch(1), params, use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(batch(2), params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = args.num_prompts * args.prompt_len
    flops = 2 * parameter_count(llm.config.model.hf_config.to_dict()) * tokens
    print(
        f"{args.num_prompts} prompts of {args.prompt_len}: {elapsed:.3f} s, "
        f"{tokens / elapsed:,.0f} prefill tok/s, {flops / elapsed / 1e12:.0f} TFLOP/s effective"
    )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(batch(3), params, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels)
    print(f"GPU kernel time {total / 1e3:.1f} ms of the profiled batch")
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"{'kernel':<90} {'ms':>9} {'share':>6} {'calls':>7}")
    for e in kernels[: args.top]:
        print(
            f"{e.key[:90]:<90} {e.self_device_time_total / 1e3:9.2f} "
            f"{100 * e.self_device_time_total / total:5.1f}% {e.count:7d}"
        )


if __name__ == "__main__":
    main()
