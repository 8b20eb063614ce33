"""Block-FP8 products of 1 to 16 rows on an NVIDIA GPU (issue 14's batch-1 goal): every launch
of the few-rows tensor-core kernel that ``kvik_cuda.tuning.fp8_block_few_rows_candidates`` lists,
against the kernels those rows take without it (the CUDA-core GEMV at one row, the tiled kernel
from 2), on Llama-3.1-8B's projections (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down
4096x14336), in one run of about two minutes on the H200 (Triton compiles included):

Also the one-row GEMV's other tilings (``FP8_GEMV_CANDIDATES``), at one row only.

1. Correctness first: each launch at 1, 3 and 16 rows (the GEMV's at 1; 16 with an all-zero row)
   against the PyTorch reference (``kvik.quantization.fp8_reference``) on NaN-poisoned outputs, a
   second call with equal bits and the split-K counters back at zero (``bench/fp8_gpu.py``'s
   checks). A launch that fails is not timed.
2. Timing at 1, 2, 4, 8 and 16 rows: each product in a CUDA graph over enough weight copies to
   exceed the 60 MB L2 four times (every weight byte from memory), median of 25 replays; then
   one more replay on new activations into poisoned outputs, checked again.
3. Printed: the fastest launch per (layer, rows) against the kernels before it, a batch-1 step's
   projections (32 layers, and the bf16 LM head timed the same way) against the 1.88 ms
   weight-read floor (8.03 GB at 4.28 TB/s) for each row count, and the text of
   ``kvik_cuda.tuning.FP8_BLOCK_FEW_ROWS`` from these figures, to paste into that file.

Run from the repository root (kvik installed):

    python3 bench/fp8_few_rows_gpu.py            # JSON to $OUT/fp8_few_rows_gpu.json if $OUT set
    python3 bench/fp8_few_rows_gpu.py --budget-s 125 --out f.json
    python3 bench/fp8_few_rows_gpu.py --layers gate_up,down --rows 1,16   # a part of it

Past ``--budget-s`` (default 125, counted from after the imports, which take seconds more) the
remaining checks and timings are skipped (said so on their lines): the layers go largest first,
so a short budget still measures most of a step's bytes.

Exits 1 if a check failed (the JSON is written first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
import triton
from fp8_gpu import (
    DEVICE,
    L2_BYTES,
    LAYERS,
    LLAMA_8B_LAYERS,
    PEAK_BYTES_PER_S,
    Product,
    activations,
    check_product,
    finish,
    fp8_weight,
    graph_us,
    reference,
    replay_check,
    walk,
)

import kvik_cuda.fp8
from kvik.bench.common import git_commit
from kvik.triton_kernels.fp8_gemm import Fp8GemvConfig
from kvik.triton_kernels.fp8_linear import fp8_block_linear
from kvik.triton_kernels.fp8_skinny import Fp8SkinnyConfig
from kvik_cuda import tuning

#: The projections, the largest share of a step's bytes first (timed first within the budget).
LAYER_ORDER = ("gate_up", "down", "qkv", "o")
ROWS = (1, 2, 4, 8, 16)
CHECK_ROWS = (1, 3, 16)
BEFORE = "before: GEMV (1 row) / tiled (2+)"
#: The one-row GEMV's other tilings (``kvik_cuda.tuning.FP8_GEMV_CANDIDATES``), timed at one row.
GEMV = "gemv "
#: A launch replaces the kernels before it in the pasted table only when this much faster: the
#: replays' medians move by about a percent between runs.
MARGIN = 0.97


def before_product(arch: str) -> Product:
    """The kernels 1 to 16 rows take without the few-rows kernel (``kvik_cuda.tuning``)."""

    def product(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        m = x.shape[0]
        config = (
            tuning.fp8_gemv_config(arch, n, k) if m == 1 else tuning.fp8_gemm_config(arch, m, n, k)
        )
        return fp8_block_linear(x, w, s, None, config)

    return product


def launch_product(config: Fp8SkinnyConfig | Fp8GemvConfig) -> Product:
    return lambda x, w, s: fp8_block_linear(x, w, s, None, config)


def weight_copies(n: int, k: int) -> tuple[list, int, int]:
    """Block-FP8 weights [n, k] with their scales, enough copies to exceed L2 four times."""
    first = fp8_weight(n, k, "block")
    weight_bytes = n * k + first[1].numel() * 4
    copies = max(1, triton.cdiv(4 * L2_BYTES, weight_bytes))
    return [first] + [fp8_weight(n, k, "block") for _ in range(copies - 1)], copies, weight_bytes


def check_launches(
    layer: str, products: dict[str, Product], weights: list, deadline: float, failures: list
) -> set[str]:
    """Each product at ``CHECK_ROWS`` (the one-row GEMV's tilings at one row) against the
    reference (its first call compiles it): the names that passed; none checked past the
    deadline."""
    n, k = LAYERS[layer]
    w, s = weights[0]
    passed = set(products)
    started = time.time()
    for m in CHECK_ROWS:
        x = activations(m, k)
        ref = reference("block", x, w, s)
        for name, product in products.items():
            if name.startswith(GEMV) and m > 1:
                continue
            if time.time() > deadline:
                passed.discard(name)
                print(f"check {layer:8} m={m:<3} {name:34} skipped: past the time budget")
                continue
            try:
                result = check_product(product, x, w, s, ref, "block")
            except Exception as error:  # noqa: BLE001  (recorded; the run goes on)
                result = {"ok": False, "why": f"{type(error).__name__}: {error}"[:300]}
            if not result["ok"]:
                passed.discard(name)
                failures.append({"layer": layer, "m": m, "launch": name, "why": result["why"]})
                print(f"check {layer:8} m={m:<3} {name:34} FAIL: {result['why'][:150]}")
    print(f"check {layer:8} {len(passed)} of {len(products)} launches ok at rows {CHECK_ROWS} "
          f"({time.time() - started:.0f} s with the compiles)")  # fmt: skip
    return passed


def time_one(layer, m, name, product, x, weights, copies, weight_bytes, failures) -> dict:
    n, k = LAYERS[layer]
    record: dict[str, Any] = {"layer": layer, "n": n, "k": k, "m": m, "launch": name}
    try:
        us, graph, outs = graph_us(walk(product, x, weights), copies)
        replay = replay_check("block", graph, outs, x, *weights[0])
        record |= {"us": us, "of_bandwidth": weight_bytes / (us * 1e-6) / PEAK_BYTES_PER_S}
        record["replay_ok"] = replay["ok"]
        if not replay["ok"]:
            record["why"] = replay["why"]
            failures.append(record)
        note = "" if replay["ok"] else f"  FAIL on replay: {replay['why'][:100]}"
        print(f"time  {layer:8} m={m:<3} {name:34} {us:8.1f} µs "
              f"{record['of_bandwidth']:6.1%}{note}")  # fmt: skip
    except Exception as error:  # noqa: BLE001  (recorded; the run goes on)
        record["error"] = f"{type(error).__name__}: {error}"[:300]
        failures.append(record)
        print(f"time  {layer:8} m={m:<3} {name:34} ERROR {record['error']}")
    return record


def sweep_layer(arch: str, layer: str, rows: list[int], deadline: float, failures: list):
    n, k = LAYERS[layer]
    candidates = tuning.fp8_block_few_rows_candidates(n, k)
    candidates |= {GEMV + name: c for name, c in tuning.FP8_GEMV_CANDIDATES.items()}
    products = {BEFORE: before_product(arch)}
    products |= {name: launch_product(config) for name, config in candidates.items()}
    weights, copies, weight_bytes = weight_copies(n, k)
    passed = check_launches(layer, products, weights, deadline, failures)
    records = []
    for m in rows:
        x = activations(m, k)
        for name, product in products.items():
            if name not in passed or (name.startswith(GEMV) and m > 1):
                continue
            if time.time() > deadline:
                print(f"time  {layer:8} m={m:<3} {name:34} skipped: past the time budget")
                continue
            args = (x, weights, copies, weight_bytes, failures)
            records.append(time_one(layer, m, name, product, *args))
    del weights
    torch.cuda.empty_cache()
    return records, {name: repr(config) for name, config in candidates.items()}


def lm_head_us(rows: list[int], deadline: float) -> dict[int, float]:
    """The bf16 LM head (128256 x 4096, 1 GB: past L2 by itself) at each row count."""
    n, k = LAYERS["lm_head"]
    head = [(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16), None)]
    times = {}
    for m in rows:
        if time.time() > deadline:
            break
        x = activations(m, k)
        times[m], _, _ = graph_us(walk(lambda x, w, s: F.linear(x, w), x, head), 1)
        print(f"time  lm_head  m={m:<3} bf16 F.linear {times[m]:8.1f} µs")
    return times


def timed_ok(record: dict) -> bool:
    return "us" in record and record.get("replay_ok", False)


def best_by_layer_and_rows(records: list[dict]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (layer, rows): the kernels before, the fastest few-rows launch, and which wins."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in filter(timed_ok, records):
        entry = best.setdefault((r["layer"], r["m"]), {"before_us": None, "launch": None})
        if r["launch"] == BEFORE:
            entry["before_us"] = r["us"]
        elif entry["launch"] is None or r["us"] < entry["launch_us"]:
            entry |= {"launch": r["launch"], "launch_us": r["us"]}
    for entry in best.values():
        before, launch = entry["before_us"], entry.get("launch_us")
        entry["launch_wins"] = launch is not None and (before is None or launch < MARGIN * before)
        entry["us"] = launch if entry["launch_wins"] else before
    return best


def step_totals(best: dict, head: dict[int, float], rows: list[int]) -> dict[int, dict]:
    """A batch-1.. 16 step's projections (32 layers) and bf16 LM head, from the kernels' times."""
    floor_bytes = LLAMA_8B_LAYERS * sum(n * k for n, k in (LAYERS[p] for p in LAYER_ORDER))
    floor_bytes += 2 * LAYERS["lm_head"][0] * LAYERS["lm_head"][1]
    floor_ms = floor_bytes / PEAK_BYTES_PER_S * 1e3
    totals = {}
    for m in rows:
        entries = [best.get((layer, m)) for layer in LAYER_ORDER]
        if m not in head or None in entries:
            continue
        total = {"floor_ms": floor_ms}
        for key in ("before_us", "us"):
            if all(e[key] is not None for e in entries):
                ms = (LLAMA_8B_LAYERS * sum(e[key] for e in entries) + head[m]) / 1e3
                total[key.replace("us", "ms")] = ms
                total[key.replace("us", "of_floor")] = floor_ms / ms
        totals[m] = total
    return totals


def table_text(best: dict, configs: dict[str, dict[str, str]], rows: list[int]) -> str:
    """``kvik_cuda.tuning.FP8_BLOCK_FEW_ROWS`` from the measurements."""
    lines = [
        "FP8_BLOCK_FEW_ROWS: dict[",
        "    tuple[int, int], dict[int, Fp8SkinnyConfig | Fp8GemvConfig | None]",
        "] = {",
    ]
    for layer in LAYER_ORDER:
        if not all((layer, m) in best for m in rows):
            continue  # not every row count measured: left to the kernels before
        n, k = LAYERS[layer]
        lines.append(f"    ({n}, {k}): {{  # {layer}")
        for m in rows:
            entry = best[(layer, m)]
            config = configs[layer][entry["launch"]] if entry["launch_wins"] else "None"
            lines.append(f"        {m}: {config},")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def layer_names(text: str) -> list[str]:
    layers = [part.strip() for part in text.split(",") if part.strip()]
    if not layers or any(layer not in LAYER_ORDER for layer in layers):
        raise argparse.ArgumentTypeError(f"projections among {LAYER_ORDER}, not {text!r}")
    return layers


def row_counts(text: str) -> list[int]:
    rows = sorted({int(part) for part in text.split(",") if part.strip()})
    limit = tuning.FP8_BLOCK_SKINNY_MIN_ROWS - 1
    if not rows or any(not 1 <= m <= limit for m in rows):
        raise argparse.ArgumentTypeError(f"row counts from 1 to {limit}, not {text!r}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out = (
        os.path.join(os.environ["OUT"], "fp8_few_rows_gpu.json") if os.environ.get("OUT") else None
    )
    parser.add_argument("--out", default=out, help="the JSON file ($OUT/fp8_few_rows_gpu.json)")
    parser.add_argument("--rows", type=row_counts, default=list(ROWS),
                        help="row counts, comma-separated (default 1,2,4,8,16)")  # fmt: skip
    parser.add_argument("--layers", type=layer_names, default=list(LAYER_ORDER),
                        help="projections, comma-separated (default gate_up,down,qkv,o)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=125.0,
                        help="skip the remaining timings past this many seconds")  # fmt: skip
    args = parser.parse_args()
    started = time.time()
    deadline = started + args.budget_s - 12  # the LM head and the JSON after the sweep
    torch.backends.cuda.matmul.allow_tf32 = False  # the references' fp32 products stay fp32
    arch = kvik_cuda.fp8.arch_of(DEVICE)
    props = torch.cuda.get_device_properties(DEVICE)
    print(f"{props.name}, {arch}, torch {torch.__version__}, triton {triton.__version__}")
    failures: list[dict] = []
    records: list[dict] = []
    configs: dict[str, dict[str, str]] = {}
    for seed, layer in enumerate(LAYER_ORDER):
        if layer not in args.layers:
            continue
        if time.time() > deadline:
            print(f"{layer}: skipped, past the time budget")
            continue
        torch.manual_seed(200 + seed)
        layer_records, configs[layer] = sweep_layer(arch, layer, args.rows, deadline, failures)
        records += layer_records
    head = lm_head_us(args.rows, started + args.budget_s - 3)
    best = best_by_layer_and_rows(records)
    print(f"\n{'layer':8} {'rows':>4} {BEFORE:>34} {'fastest few-rows launch':>40}")
    for (layer, m), e in sorted(best.items(), key=lambda item: LAYER_ORDER.index(item[0][0])):
        n, k = LAYERS[layer]
        weight_bytes = n * k + triton.cdiv(n, 128) * triton.cdiv(k, 128) * 4
        share = weight_bytes / PEAK_BYTES_PER_S * 1e6  # µs at the bandwidth
        before = f"{e['before_us']:.1f} µs {share / e['before_us']:.1%}" if e["before_us"] else "-"
        launch = (f"{e['launch_us']:.1f} µs {share / e['launch_us']:.1%} {e['launch']}"
                  if e["launch"] else "-")  # fmt: skip
        print(
            f"{layer:8} {m:>4} {before:>34} {launch:>40}{'  <- wins' if e['launch_wins'] else ''}"
        )
    totals = step_totals(best, head, args.rows)
    for m, t in totals.items():
        before = f"{t['before_ms']:.3f} ms" if "before_ms" in t else "-"
        print(f"step's projections + LM head at {m:>2} rows: before {before}, with the fastest "
              f"{t.get('ms', float('nan')):.3f} ms ({t.get('of_floor', 0):.1%} of the "
              f"{t['floor_ms']:.3f} ms floor)")  # fmt: skip
    text = table_text(best, configs, args.rows)
    print("\nFor packages/platform-cuda/src/kvik_cuda/tuning.py, replacing FP8_BLOCK_FEW_ROWS "
          "(then ruff format it):\n")  # fmt: skip
    print(text)
    if failures:
        print(f"\n{'!' * 80}\n{len(failures)} CHECKS FAILED (launches that failed were not timed)")
        for f in failures:
            print(f"  FAIL {f.get('layer')} m={f.get('m')} {f.get('launch')}: "
                  f"{f.get('why') or f.get('error')}")  # fmt: skip
    result = {
        "device": props.name, "arch": arch, "torch": torch.__version__,
        "triton": triton.__version__, "commit": git_commit(), "rows": args.rows,
        "peak_bytes_per_s": PEAK_BYTES_PER_S, "configs": configs, "timings": records,
        "lm_head_us": head, "best": [{"layer": layer, "m": m} | e for (layer, m), e in best.items()],
        "step": totals, "tuning_table": text, "failures": failures,
        "seconds": time.time() - started,
    }  # fmt: skip
    return finish(result, args.out, failures, started)


if __name__ == "__main__":
    sys.exit(main())
