"""What the benchmark commands share: the random workload, their options, percentiles, JSON."""

from __future__ import annotations

import argparse
import json
import platform as host
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvik


@dataclass
class Workload:
    """Prompts of random token ids and the number of tokens each must produce."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def to_json(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "output_lens": self.output_lens}


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    range_ratio: float = 0.0,
) -> Workload:
    """vLLM's random dataset: lengths uniform in ``[len * (1 - r), len * (1 + r)]``, token ids
    uniform away from both ends of the vocabulary, where special tokens live."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    margin = min(100, vocab_size // 4)

    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio)))

    prompts, output_lens = [], []
    for _ in range(num_prompts):
        n = length(input_len)
        prompts.append([rng.randrange(margin, vocab_size - margin) for _ in range(n)])
        output_lens.append(length(output_len))
    return Workload(prompts, output_lens)


def warmup_workload(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> Workload:
    """A few short requests from another seed than the timed ones: the same prompt lengths, so
    prefill paths warm up, and no prompt that prefix caching could reuse."""
    return random_workload(num_prompts, input_len, 4, vocab_size, seed + 1_000_003)


def add_workload_arguments(parser: argparse.ArgumentParser, num_prompts: int = 32) -> None:
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths vary uniformly by this fraction around --input-len/--output-len "
        "(0, the default: fixed lengths)",
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="stop at end-of-sequence (default: ignore it, so every request does the same work)",
    )
    parser.add_argument("--output-json", default=None, help="write the results to this file")


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Linearly interpolated percentiles, as numpy's default."""
    ordered = sorted(values)
    result = {}
    for p in points:
        if not ordered:
            result[f"p{p}"] = 0.0
            continue
        k = (len(ordered) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        result[f"p{p}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return result


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def device_description(llm: Any) -> str:
    """The platform kvik ran on and the chip: the CPU's model and threads, or the GPU's name."""
    import torch

    platform = llm.engine.platform
    if platform.device_type == "cpu":
        return f"{platform.name}: {cpu_model()}, {torch.get_num_threads()} threads"
    module = getattr(torch, platform.device_type, None)
    name = module.get_device_name(0) if module is not None else platform.device_type
    return f"{platform.name}: {name}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host.processor() or host.machine()


def base_result(system: str, model: str | None) -> dict[str, Any]:
    return {"system": system, "model": model, "kvik_version": kvik.__version__}


def write_json(result: dict[str, Any], path: str | None) -> None:
    text = json.dumps(result)
    print(text, flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
