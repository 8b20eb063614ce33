"""The host's share of a decode step at a large batch, part by part: ``Scheduler.schedule``,
``ModelRunner.prepare_inputs``, ``Scheduler.update_from_output`` and the front end's
``OutputProcessor.process_outputs``, timed around each call (no profiler) over the steady decode
steps of an offline ``LLM.generate``, medians per step.

    python bench/host_step_time.py [--batch-size 256] [--output-len 96] [--model FOLDER]

The model is tiny by default (Llama-3.1-8B's config shrunk to two layers of hidden 64, dummy
weights, fp32 on the CPU), so the forward pass stays small beside the host's work; the parts
timed are the same Python on every platform. On a GPU the engine hides them behind the device's
step only while they take less time than it: at batch 256 over short contexts an FP8 model's step
is ~6-8 ms on an H100, so a slow host bounds it (docs/benchmarks.md, the fifty-seventh session).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvik import LLM, SamplingParams

LLAMA_8B = Path(__file__).resolve().parent / "models" / "llama-3.1-8b" / "config.json"
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "max_position_embeddings": 4096,
}


def tiny_model(folder: Path) -> str:
    config = json.loads(LLAMA_8B.read_text())
    config.update(TINY)
    config.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def timed(times: dict[str, list[float]], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        times[label].append(time.perf_counter() - started)
        return result

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny Llama)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or tiny_model(Path(folder))
        llm = LLM(
            model=model,
            load_format="dummy",
            dtype="float32" if args.model is None else "auto",
            device=args.device,
            max_model_len=args.prompt_len + args.output_len + 16,
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=max(8192, args.batch_size),
        )
    vocab = llm.config.model.vocab_size
    prompts = [
        {"prompt_token_ids": [(7919 * (i * args.prompt_len + j)) % vocab for j in range(args.prompt_len)]}
        for i in range(args.batch_size)
    ]  # fmt: skip
    warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:8], warmup, use_tqdm=False)

    times: dict[str, list[float]] = defaultdict(list)
    engine = llm.engine
    runner = engine.executor.model_runner
    scheduler = engine.scheduler
    scheduler.schedule = timed(times, "schedule", scheduler.schedule)
    runner.prepare_inputs = timed(times, "prepare_inputs", runner.prepare_inputs)
    scheduler.update_from_output = timed(times, "update_from_output", scheduler.update_from_output)
    processor = llm.output_processor
    processor.process_outputs = timed(times, "process_outputs", processor.process_outputs)
    engine.step = timed(times, "engine step (all of it)", engine.step)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    print(
        f"batch {args.batch_size}, {args.prompt_len} prompt tokens, {args.output_len} decode steps"
    )
    for label, values in times.items():
        steady = values[4:]  # past the prefill steps
        print(f"{label:24s} median {statistics.median(steady) * 1e3:7.3f} ms a step")


if __name__ == "__main__":
    main()
