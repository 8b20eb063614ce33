"""The GPU benchmarks of docs/benchmarks.md: kvik against transformers on the H200, one call.

    python3 -m nox -s gpu -- speed [options]      # on the GPU machine (installs kvik first)
    python bench/run_gpu.py [options] [kvik engine options]
    python bench/run_gpu.py --collect DIR ...     # here: file a run's JSON, print its table

Llama-3.1-8B shapes (bench/models/llama-3.1-8b: a config.json and no weights), bf16, greedy, EOS
ignored, random token ids (seeded), so that nothing is downloaded (the GPU machine has no network):

    A  gpu-latency             batch 1, 128 in, 256 out    transformers generate(), static cache
    B  gpu-decode-throughput   256 prompts, 128 in, 1024 out   transformers generate(), batch 256
    C  gpu-prefill-heavy       1000 prompts, 1024 in, 128 out  kvik only (issue 13's total tok/s goal)
    D  gpu-decode-64           64 prompts, 128 in, 1024 out    kvik only (the 70B tensor-parallel run)

For each workload kvik (``kvik bench throughput``, dummy weights, the default engine arguments
unless more are given) and then transformers (bench/peers/hf_generate_bench.py, random weights)
run, each in a fresh process, on the same prompts. Warm-ups: kvik one prompt of the timed lengths
at batch 1, 64 prompts of 32 tokens for B; transformers a whole run of the timed shape with the
static cache (that is its compile), two short prompts otherwise.

Every run's JSON (the fields of ``kvik bench throughput --output-json``: system, num_prompts,
input_len, output_len, output_tok_s, total_tok_s, device, date, commit, engine_args, ...) goes into
--out ($OUT, else ./gpu-results) and --results-dir (benchmarks/results), named
``<date>_<workload>_<system>.json``; then a markdown table for docs/benchmarks.md is printed. The
limit column is the roofline of the workload, all prompts at once, on the run's device
(kvik.bench.roofline: prefill at the device's FLOP/s, then each decode step reading every weight and
each request's KV cache at its bandwidth, or its FLOPs, if more).

Engine options run_gpu does not know (``--enforce-eager``, ``--no-async-scheduling``, ...) go to
kvik; its JSON then lists them in engine_args and its system is named after them
(``kvik-enforce-eager``). On a machine that is no git checkout, set KVIK_BENCH_COMMIT to the commit
carried there, so that the records name it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvik.bench.roofline import ModelCost, across_ranks, device_limits, workload_roofline

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / "peers"
DEFAULT_MODEL = ROOT / "bench" / "models" / "llama-3.1-8b"
RESULTS_DIR = ROOT / "benchmarks" / "results"

#: The H200's figures the limit column uses, from kvik.bench.roofline's table (which says where
#: they come from); `kvik bench throughput` computes its own roofline with the same code.
H200 = device_limits("NVIDIA H200")

#: Engine options the harness sets itself (or that would change what is measured).
RESERVED_KVIK_OPTIONS = ("model", "tokenizer", "device", "dtype", "load_format", "seed")


@dataclass(frozen=True)
class GpuWorkload:
    key: str
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    kvik_warmup_prompts: int
    kvik_warmup_output_len: int
    peer_static_cache: bool
    #: Whether transformers runs it too (C's goal is kvik's own total tok/s, and transformers
    #: would spend minutes of the call on a thousand 1024-token prompts).
    has_peer: bool = True

    @property
    def label(self) -> str:
        shape = f"{self.input_len} in, {self.output_len} out"
        if self.num_prompts == 1:
            return f"{self.key}: batch 1, {shape}"
        return f"{self.key}: {self.num_prompts} prompts, {shape}"


WORKLOADS = {
    "A": GpuWorkload("A", "gpu-latency", 1, 128, 256, 1, 256, True),
    "B": GpuWorkload("B", "gpu-decode-throughput", 256, 128, 1024, 64, 32, False),
    "C": GpuWorkload("C", "gpu-prefill-heavy", 1000, 1024, 128, 64, 16, False, has_peer=False),
    "D": GpuWorkload("D", "gpu-decode-64", 64, 128, 1024, 16, 32, False, has_peer=False),
}


def main(argv: list[str] | None = None) -> int:
    args, kvik_args = parse_args(argv)
    if args.collect:
        return collect(args)
    results_dir = Path(args.results_dir) if args.results_dir else None
    out_dir = Path(args.out)
    model = Path(args.model)
    config = json.loads((model / "config.json").read_text())
    started = utc_now()
    commit = commit_of_tree()
    env = child_env(commit)
    label = args.label or kvik_label(kvik_args)
    clock = Clock()
    clock.log(
        f"run {started}, commit {commit or 'unknown'}; workloads {','.join(args.workloads)}; "
        f"kvik args {shlex.join(kvik_args) or '(defaults)'}; out {out_dir}"
    )
    records: list[dict[str, Any]] = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kvik-gpu-bench-") as tmp:
        plan = []
        for key in args.workloads:
            workload = WORKLOADS[key]
            workload_file = Path(tmp) / f"{key}.json"
            write_workload(workload_file, workload, config["vocab_size"], args.seed)
            json_path = Path(tmp) / f"{key}-kvik.json"
            plan.append((workload, label, kvik_command(args, workload, kvik_args, json_path)))
            if not args.skip_peers and workload.has_peer:
                peer = "transformers-static-cache" if workload.peer_static_cache else "transformers"
                plan.append((workload, peer, peer_command(args, workload, workload_file)))
        for workload, system, command in plan:
            clock.log(f"{workload.key} {system}: {shlex.join(command)}")
        if args.dry_run:
            return 0
        out_dir.mkdir(parents=True, exist_ok=True)
        for workload, system, command in plan:
            left = args.budget_s - clock.elapsed()
            if left < 30:
                clock.log(f"{workload.key} {system}: skipped, {left:.0f} s of --budget-s left")
                failed += 1
                continue
            timeout = min(args.timeout_s, left)
            raw, wall = run_one(command, env, timeout, clock, f"{workload.key} {system}")
            record = finish_record(raw, workload, system, command, wall, started, commit, config)
            name = record_filename(record)
            write_record(out_dir / name, record)
            if "error" in record:
                failed += 1
                continue
            if results_dir is not None:
                write_record(results_dir / name, record)
            records.append(record)
            clock.log(
                f"{workload.key} {system}: {record['output_tok_s']} output tok/s, "
                f"{record['total_tok_s']} total tok/s (wall {wall:.0f} s) -> {name}"
            )
    print()
    print(report(records, command_line(argv)))
    clock.log(f"done: {len(records)} runs measured, {failed} failed or skipped")
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    parser.add_argument(
        "--workloads",
        type=lambda s: [w.strip().upper() for w in s.split(",") if w.strip()],
        default=["A", "B", "C"],
        help="comma-separated, of " + ", ".join(WORKLOADS) + " (default: A,B,C)",
    )
    parser.add_argument("--skip-peers", action="store_true", help="kvik only, no transformers")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a folder with a config.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="prompts' and weights' seed")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "gpu-results",
        help="where every run's JSON goes (default: $OUT, else ./gpu-results)",
    )
    parser.add_argument(
        "--results-dir",
        default=str(RESULTS_DIR),
        help="the records' folder, benchmarks/results (default); '' for none",
    )
    parser.add_argument(
        "--label", default=None, help="kvik's system name (default: kvik, + its extra options)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=500,
        help="seconds for the whole run (default 500, so that a device call of 600 s holds it and "
        "nox's installs); a run is cut at the budget's end, and later ones are skipped",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=300, help="seconds one run may take (default 300)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the commands and check the options only"
    )
    parser.add_argument(
        "--collect",
        nargs="+",
        metavar="PATH",
        default=None,
        help="instead of running: file the run JSONs found in these files or folders (a device "
        "call's $OUT) into --results-dir and print their table",
    )
    args, extra = parser.parse_known_args(argv)
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    if extra and extra[0] == "--":
        extra = extra[1:]
    problem = check_kvik_args(extra)
    if problem:
        parser.error(problem)
    return args, extra


def check_kvik_args(extra: list[str]) -> str | None:
    """Why the options meant for kvik's engine cannot go to it, or None if they can."""
    from kvik.cli.engine_args import add_engine_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_engine_arguments(parser)
    defaults = vars(parser.parse_args([]))
    try:
        given, unknown = parser.parse_known_args(extra)
    except SystemExit:
        return f"kvik's engine does not take {shlex.join(extra)}"
    if unknown:
        return f"neither run_gpu.py nor kvik's engine takes {shlex.join(unknown)}"
    reserved = [
        name
        for name in RESERVED_KVIK_OPTIONS
        if getattr(given, name, None) != defaults.get(name, None)
    ]
    if reserved:
        return f"run_gpu.py sets {', '.join(reserved)} itself (use its --model/--device/--dtype/--seed)"
    return None


def kvik_label(kvik_args: list[str]) -> str:
    """``kvik``, or ``kvik-`` and the extra options as a file-name-safe word."""
    if not kvik_args:
        return "kvik"
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", " ".join(kvik_args)).strip("-").lower()
    return f"kvik-{slug}"[:80].rstrip("-")


class Clock:
    """Log lines with the wall-clock time (UTC) and the seconds since the run began."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def log(self, message: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
        print(f"[{now} +{self.elapsed():5.0f}s] {message}", flush=True)


def utc_now() -> str:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


def commit_of_tree() -> str | None:
    from kvik.bench.common import git_commit

    return git_commit(ROOT)


def child_env(commit: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    if commit:
        env["KVIK_BENCH_COMMIT"] = commit
    return env


def write_workload(path: Path, workload: GpuWorkload, vocab: int, seed: int) -> None:
    """The prompts for the peer: ``kvik bench throughput`` draws the same ones from the same
    seed and vocabulary."""
    from kvik.bench.common import random_workload, warmup_workload

    timed = random_workload(
        workload.num_prompts, workload.input_len, workload.output_len, vocab, seed
    )
    warmup = warmup_workload(2, workload.input_len, vocab, seed)
    body = {"input_len": workload.input_len, "output_len": workload.output_len, **timed.to_json()}
    path.write_text(json.dumps({**body, "warmup": warmup.to_json()}))


def kvik_command(
    args: argparse.Namespace, workload: GpuWorkload, kvik_args: list[str], json_path: Path
) -> list[str]:
    return [
        sys.executable, "-m", "kvik", "bench", "throughput",
        "--model", str(args.model), "--load-format", "dummy", "--dtype", args.dtype,
        "--device", args.device, "--seed", str(args.seed),
        "--num-prompts", str(workload.num_prompts), "--input-len", str(workload.input_len),
        "--output-len", str(workload.output_len),
        "--num-warmup-prompts", str(workload.kvik_warmup_prompts),
        "--warmup-output-len", str(workload.kvik_warmup_output_len),
        "--output-json", str(json_path),
        *kvik_args,
    ]  # fmt: skip


def peer_command(args: argparse.Namespace, workload: GpuWorkload, workload_file: Path) -> list[str]:
    command = [
        sys.executable, str(PEERS / "hf_generate_bench.py"), str(args.model), str(workload_file),
        "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed),
    ]  # fmt: skip
    return command + (["--static-cache"] if workload.peer_static_cache else [])


def run_one(
    command: list[str], env: dict[str, str], timeout: float, clock: Clock, what: str
) -> tuple[dict[str, Any], float]:
    """Runs one system in a process group of its own; its result is the last JSON line it
    printed, or an error. A run past ``timeout`` is killed with everything it started."""
    clock.log(f"{what}: start (timeout {timeout:.0f} s)")
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    wall = time.monotonic() - start
    tail = [line[:200] for line in stderr.splitlines() if line.strip()][-6:]
    for line in tail:
        print(f"    | {line}")
    if timed_out:
        return {"error": f"timed out after {timeout:.0f} s"}, wall
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), wall
            except json.JSONDecodeError:
                break
    error = f"exit {proc.returncode}: " + "\n".join(stderr.strip().splitlines()[-20:])[-2000:]
    clock.log(f"{what}: failed, {error.splitlines()[0]}")
    return {"error": error}, wall


def finish_record(
    raw: dict[str, Any],
    workload: GpuWorkload,
    system: str,
    command: list[str],
    wall_s: float,
    run: str,
    commit: str | None,
    config: dict[str, Any],
) -> dict[str, Any]:
    """A run's JSON as filed: the system's own fields, with the workload, the run it belongs
    to and its command; the commit, date, engine_args and device where the system left them out."""
    record = dict(raw)
    record["system"] = system
    record["workload"] = workload.key
    record["workload_name"] = workload.name
    for key in ("num_prompts", "input_len", "output_len"):
        record.setdefault(key, getattr(workload, key))
    record.setdefault("date", utc_now())
    if record.get("commit") is None:
        record["commit"] = commit
    record.setdefault("engine_args", {})
    record.setdefault("device", None)
    record["run"] = run
    record["command"] = shlex.join(command)
    record["wall_s"] = round(wall_s, 1)
    limits = device_limits(record["device"])
    if limits is None:
        record["limit_basis"] = f"none: kvik.bench.roofline has no figures for {record['device']}"
        record["limit_device"] = record["limit_output_tok_s"] = None
        return record
    kv_fp8 = str(record["engine_args"].get("kv_cache_dtype", "auto")).startswith("fp8")
    ranks = int(record["engine_args"].get("tensor_parallel_size") or 1)
    limits = across_ranks(limits, ranks)  # tensor parallelism: one device a rank
    roofline = workload_roofline(
        ModelCost.from_config(config, kv_dtype_bytes=1 if kv_fp8 else None), limits,
        record["num_prompts"], record["input_len"], record["output_len"],
    )  # fmt: skip
    record["limit_basis"] = f"roofline on {limits.name} (kvik.bench.roofline): {limits.source}"
    record["limit_device"] = limits.name
    record["limit_output_tok_s"] = round(roofline.limit_output_tok_s, 1)
    return record


def record_filename(record: dict[str, Any]) -> str:
    """``<run date>_<workload>-<name>_<system>.json``, in letters, digits, '.', '_' and '-'."""
    stamp = re.sub(r"[^0-9T]", "", record["run"].split("+")[0])[:13]  # 20261130T1012
    stamp = f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}T{stamp[9:13]}Z"
    system = re.sub(r"[^A-Za-z0-9.-]+", "-", record["system"])
    return f"{stamp}_{record['workload']}-{record['workload_name']}_{system}.json"


def write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "bench/run_gpu.py", *args])


def report(records: list[dict[str, Any]], command: str | None = None) -> str:
    """A paragraph on the run(s) and the table: one row per workload and kvik system."""
    if not records:
        return "(no run measured)"
    by_run: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_run.setdefault(record.get("run", "?"), []).append(record)
    parts = []
    for run, group in by_run.items():
        parts.append(run_header(run, group, command))
        parts.append("")
        parts.append(table(group))
        parts.append("")
    return "\n".join(parts).rstrip("\n")


def run_header(run: str, records: list[dict[str, Any]], command: str | None) -> str:
    def values(key: str) -> str:
        found = sorted({str(r.get(key)) for r in records if r.get(key) is not None})
        return ", ".join(found) or "unknown"

    kvik_args = sorted({json.dumps(r.get("engine_args") or {}) for r in records if is_kvik(r)})
    models = sorted({Path(str(r.get("model"))).name for r in records if r.get("model")})
    line = (
        f"Run {run} on {values('device')} (torch {values('torch_version')}, transformers "
        f"{values('transformers_version')}), kvik commit {values('commit')}; model "
        f"{', '.join(models) or 'unknown'} (shapes only: kvik with dummy weights, transformers "
        f"with random ones), {values('dtype')}, greedy, EOS ignored, random prompts (seed "
        f"{values('seed')}); kvik engine arguments: "
        + (", ".join(a for a in kvik_args if a != "{}") or "defaults")
        + "."
    )
    if command:
        line += f" Command: `{command}`."
    return line


def is_kvik(record: dict[str, Any]) -> bool:
    return str(record.get("system", "")).startswith("kvik")


def table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | system | output tok/s | total tok/s | transformers output tok/s "
        "| kvik / transformers | limit (output tok/s) | of limit |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = sorted({r["workload"] for r in records})
    for key in keys:
        group = [r for r in records if r["workload"] == key]
        peers = [r for r in group if str(r["system"]).startswith("transformers")]
        peer = peers[0] if peers else None
        kviks = [r for r in group if is_kvik(r)] or [None]
        for kvik in kviks:
            some = kvik or peer
            workload = WORKLOADS.get(key)
            name = workload.label if workload else key
            if (
                some
                and workload
                and (some["num_prompts"], some["input_len"], some["output_len"])
                != (workload.num_prompts, workload.input_len, workload.output_len)
            ):
                name = f"{key}: {some['num_prompts']} x ({some['input_len']}, {some['output_len']})"
            limit = (some or {}).get("limit_output_tok_s")
            limits = device_limits((some or {}).get("device"))
            if limits is not None:
                ranks = int((some or {}).get("engine_args", {}).get("tensor_parallel_size") or 1)
                limits = across_ranks(limits, ranks)
            if limits is None or (some or {}).get("limit_device", H200.name) != limits.name:
                limit = None  # the record's limit is another device's
            kvik_tok = kvik["output_tok_s"] if kvik else None
            peer_tok = peer["output_tok_s"] if peer else None
            peer_cell = _number(peer_tok)
            if peer and peer["system"] != "transformers":
                peer_cell += f" ({peer['system'].removeprefix('transformers-').replace('-', ' ')})"
            ratio = f"{kvik_tok / peer_tok:.2f}x" if kvik_tok and peer_tok else "-"
            share = f"{100 * kvik_tok / limit:.1f}%" if kvik_tok and limit else "-"
            lines.append(
                f"| {name} | {kvik['system'] if kvik else '-'} | {_number(kvik_tok)} | "
                f"{_number(kvik.get('total_tok_s') if kvik else None)} | {peer_cell} | {ratio} | {_number(limit, 0)} | {share} |"
            )
    return "\n".join(lines)


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def load_records(paths: list[str]) -> list[dict[str, Any]]:
    """The measured run JSONs (with a workload and no error) in these files and folders."""
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    records = []
    for file in files:
        try:
            record = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and "workload" in record and "run" in record:
            if "error" not in record:
                records.append(record)
    return records


def collect(args: argparse.Namespace) -> int:
    records = load_records(args.collect)
    if not records:
        print(f"no run JSON in {' '.join(args.collect)}", file=sys.stderr)
        return 1
    if args.results_dir:
        for record in records:
            path = Path(args.results_dir) / record_filename(record)
            write_record(path, record)
            print(f"filed {path}")
    print()
    print(report(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
