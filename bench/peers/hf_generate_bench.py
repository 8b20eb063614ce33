"""Hugging Face transformers ``generate()`` on random token ids, greedy, EOS ignored; one JSON line.

    python bench/peers/hf_generate_bench.py MODEL [WORKLOAD.json] [--device cuda] [--dtype bfloat16]
        [--num-prompts N --input-len N --output-len N --seed N] [--static-cache]

MODEL is a model folder; a folder (or a config.json in one) without weights builds the model from
its config with random weights (seeded), for speed runs of real shapes. WORKLOAD.json is a workload
file of bench/run_cpu.py or bench/run_gpu.py (the prompts, and a warm-up); without one the prompts
are drawn here (``--num-prompts`` prompts of ``--input-len`` random ids, seeded).

transformers has no scheduler, so every prompt goes into one batch, as a user would call it; that
needs fixed lengths (a workload with range ratio 0). ``min_new_tokens`` makes it ignore EOS.
``--static-cache`` sets ``cache_implementation="static"``, which generate() then compiles itself:
transformers' fastest stock path at batch 1. Its warm-up is then a whole run of the timed shape
(the compile); otherwise two short prompts.

The JSON has the fields of ``kvik bench throughput --output-json``: system, model, num_prompts,
input_len, output_len, elapsed_s, output_tok_s, total_tok_s, device (as torch names it), date
(UTC), commit (of this repository: $KVIK_BENCH_COMMIT or git; null if neither), engine_args (the
generate() options that are not the defaults). This script needs torch and transformers only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model folder, or its config.json (no weights: random ones)")
    parser.add_argument("workload", nargs="?", help="a workload file (default: random prompts)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--static-cache",
        action="store_true",
        help="static KV cache, which generate() compiles itself: transformers' fastest stock path",
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    folder = Path(args.model)
    if folder.is_file():
        folder = folder.parent
    dtype = getattr(torch, args.dtype)
    random_weights = not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin"))
    if random_weights:
        config = AutoConfig.from_pretrained(folder)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(args.device):
                model = AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(previous)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device)
    model = model.eval()
    if args.static_cache:
        model.generation_config.cache_implementation = "static"

    if args.workload:
        with open(args.workload) as f:
            workload = json.load(f)
    else:
        workload = random_workload(args, model.config.vocab_size)

    def synchronize() -> None:
        if args.device != "cpu":
            torch.cuda.synchronize()

    def run(prompts: list[list[int]], output_lens: list[int]) -> int:
        if len({len(p) for p in prompts}) != 1 or len(set(output_lens)) != 1:
            raise SystemExit("transformers' batch needs fixed lengths: use range ratio 0")
        ids = torch.tensor(prompts, device=args.device)
        n = output_lens[0]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
        synchronize()
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    prompts, output_lens = workload["prompts"], workload["output_lens"]
    with torch.inference_mode():
        if args.static_cache:
            # The compile: the timed shape, since a static cache of another size recompiles.
            run(prompts, output_lens)
        else:
            run(workload["warmup"]["prompts"], workload["warmup"]["output_lens"])
        synchronize()
        start = time.perf_counter()
        num_output = run(prompts, output_lens)
        elapsed = time.perf_counter() - start
    if num_output != sum(output_lens):
        raise SystemExit(f"transformers produced {num_output} tokens, expected {sum(output_lens)}")
    num_input = sum(len(p) for p in prompts)
    print(
        json.dumps(
            {
                "system": "transformers-static-cache" if args.static_cache else "transformers",
                "model": args.model,
                "num_prompts": len(prompts),
                "input_len": workload["input_len"],
                "output_len": workload["output_len"],
                "dtype": args.dtype,
                "random_weights": random_weights,
                "elapsed_s": round(elapsed, 4),
                "num_output_tokens": num_output,
                "output_tok_s": round(num_output / elapsed, 2),
                "total_tok_s": round((num_output + num_input) / elapsed, 2),
                "device": device_name(args.device),
                "date": utc_now(),
                "commit": git_commit(),
                "engine_args": {"cache_implementation": "static"} if args.static_cache else {},
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
            }
        ),
        flush=True,
    )


def random_workload(args: argparse.Namespace, vocab_size: int) -> dict:
    """Prompts as kvik.bench.common.random_workload draws them (same seed, same ids), with two
    short warm-up prompts from another seed."""

    def draw(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[list[int]]:
        # The same draws, in the same order, as kvik's (fixed lengths: range ratio 0).
        rng = random.Random(seed)
        margin = min(100, vocab_size // 4)
        prompts = []
        for _ in range(num_prompts):
            n = rng.randint(input_len, input_len)
            prompts.append([rng.randrange(margin, vocab_size - margin) for _ in range(n)])
            rng.randint(output_len, output_len)
        return prompts

    return {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prompts": draw(args.num_prompts, args.input_len, args.output_len, args.seed),
        "output_lens": [args.output_len] * args.num_prompts,
        "warmup": {
            "prompts": draw(2, args.input_len, 4, args.seed + 1_000_003),
            "output_lens": [4, 4],
        },
    }


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def utc_now() -> str:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


def git_commit() -> str | None:
    if os.environ.get("KVIK_BENCH_COMMIT"):
        return os.environ["KVIK_BENCH_COMMIT"]
    try:
        proc = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


if __name__ == "__main__":
    main()
