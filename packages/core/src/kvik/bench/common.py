"""What the benchmark commands share: the random workload, their options, percentiles, JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as host
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kvik
from kvik.spec_decode.metrics import SpecDecodingStats


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


def check_fits(workload: Workload, max_model_len: int) -> None:
    """Refuse, before anything runs, a request whose prompt and output exceed the model's context:
    the engine would cut its output short and the run would fail at its end."""
    for prompt, output_len in zip(workload.prompts, workload.output_lens):
        if len(prompt) + output_len > max_model_len:
            raise ValueError(
                f"a request of {len(prompt)} prompt and {output_len} output tokens needs "
                f"{len(prompt) + output_len} tokens, more than max_model_len={max_model_len}: "
                "lower --input-len / --output-len (or --range-ratio), or raise --max-model-len"
            )


def warmup_workload(
    num_prompts: int, input_len: int, vocab_size: int, seed: int, output_len: int = 4
) -> Workload:
    """A few short requests from another seed than the timed ones: the same prompt lengths, so
    prefill paths warm up, and no prompt that prefix caching could reuse."""
    return random_workload(num_prompts, input_len, output_len, vocab_size, seed + 1_000_003)


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


def device_name(device_type: str) -> str:
    """The chip as torch names it ("NVIDIA H200"), or the CPU's model name."""
    import torch

    if device_type == "cpu":
        return cpu_model()
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "get_device_name"):
        return device_type
    return module.get_device_name(module.current_device())


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


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second: ``2026-11-30T10:12:03Z``."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


#: Set by whoever runs the benchmark where the tree is no git checkout (bench/run_gpu.py passes it
#: on to the processes it starts).
COMMIT_ENV = "KVIK_BENCH_COMMIT"


def git_commit(path: str | os.PathLike[str] | None = None) -> str | None:
    """The commit measured: $KVIK_BENCH_COMMIT if set, else ``git rev-parse HEAD`` in ``path``
    (default: the folder of kvik's source, which is the repository for an editable install);
    None where neither is available (an installed kvik, a machine without git)."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    folder = Path(path) if path is not None else Path(kvik.__file__).resolve().parent
    try:
        proc = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = proc.stdout.strip()
    return commit if proc.returncode == 0 and commit else None


#: Engine options that say what is measured (the model, its weights and dtype, the workload's
#: seed, the platform), not how the engine runs it; they are recorded in fields of their own.
NOT_ENGINE_ARGS = frozenset(
    {"model", "model_positional", "tokenizer", "device", "dtype", "load_format", "seed"}
)


def non_default_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of ``args`` (kvik.cli.engine_args) that differ from their defaults,
    under their ``LLM`` keyword names; empty when the engine runs as it does by default."""
    from kvik.cli.engine_args import add_engine_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    defaults = vars(parser.parse_args([]))
    given = vars(args)
    return {
        name: given[name]
        for name in sorted(defaults)
        if name in given and name not in NOT_ENGINE_ARGS and given[name] != defaults[name]
    }


def resolved_engine_config(llm: Any) -> dict[str, Any]:
    """What the engine made of its options (None where this version of the engine has no such
    setting): whether CUDA graphs and asynchronous scheduling were on."""
    config = getattr(llm, "config", None)
    compilation = getattr(config, "compilation", None)
    scheduler = getattr(config, "scheduler", None)
    return {
        "enforce_eager": getattr(config, "enforce_eager", None),
        "cudagraph_mode": getattr(compilation, "cudagraph_mode", None),
        "async_scheduling": getattr(config, "async_scheduling", None),
        "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
        "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
    }


def run_metadata(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The fields every kvik benchmark JSON carries beside its figures: the device as torch names
    it, when (UTC), which commit, and the engine options that were not the defaults."""
    import torch

    platform = llm.engine.platform
    metadata: dict[str, Any] = {
        "device": device_name(platform.device_type),
        "platform": platform.name,
        "date": utc_now(),
        "commit": git_commit(),
        "engine_args": non_default_engine_args(args),
        "engine_config": resolved_engine_config(llm),
        "load_format": getattr(llm.config.model, "load_format", None),
        "seed": getattr(args, "seed", None),
        "torch_version": torch.__version__,
    }
    if platform.device_type == "cpu":
        metadata["threads"] = torch.get_num_threads()
    return metadata


def scheduler_counts(llm: Any, before: Any = None) -> dict[str, int]:
    """The engine's steps, preemptions and prefill chunks (since ``before``, an earlier
    ``llm.stats``), and the KV cache's size: what tells a run that preempted (recomputing
    prompts) from one that did not, when two runs of one workload differ."""
    after = llm.stats
    counts = {
        name: getattr(after, name) - (getattr(before, name) if before is not None else 0)
        for name in ("num_steps", "num_preemptions", "num_prefill_chunks")
    }
    kv = llm.engine.scheduler.kv
    return counts | {"kv_cache_blocks": kv.num_blocks, "block_size": kv.block_size}


def spec_decoding_counts(llm: Any) -> SpecDecodingStats | None:
    """The engine's cumulative speculative decoding counts (None: speculation is off)."""
    return llm.stats.spec_decoding


def report_spec_decoding(
    llm: Any, before: SpecDecodingStats | None, result: dict[str, Any], command: str
) -> None:
    """Acceptance over the timed run (the counts now minus ``before``) into ``result`` and onto
    stderr, where the engine speculates: acceptance rate, mean accepted length, per position."""
    after = spec_decoding_counts(llm)
    if after is None:
        return
    run = after.minus(before)
    result["spec_decoding"] = run.to_json()
    print(f"{command}: speculative decoding: {run.summary()}", file=sys.stderr)


def write_json(result: dict[str, Any], path: str | None) -> None:
    text = json.dumps(result)
    print(text, flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
