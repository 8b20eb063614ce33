"""The GEMV (kvik.triton_kernels.gemv) against cuBLAS's ``F.linear`` at 1 to 8 rows, on
Llama-3.1-8B's projections that the H200 tuning gives the GEMV (K <= 8192), bf16:

    python bench/gemv_rows_gpu.py

Each product runs in a CUDA graph over enough weight copies to exceed 4x the L2, so every weight
byte comes from memory; the figure is the median µs of one product. Each GEMV result is checked
row by row against the same row computed alone (bit for bit) and against F.linear (relative error
below 1e-2). Prints a table and, per shape, the rows up to which the GEMV is not slower; writes
JSON to $OUT/gemv_rows_gpu.json where OUT is set. About 30 s on an H200.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096)}
ROWS = range(1, 9)
L2_BYTES = 60 * 2**20
REPLAYS = 20


def graph_us(call, copies: int) -> float:
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / copies


def time_both(x, weights, config) -> tuple[float, float]:
    """(GEMV µs, F.linear µs) of one product of x by each of ``weights`` in turn."""
    from kvik.triton_kernels.gemv import gemv

    copies = len(weights)
    gemv_us = graph_us(lambda: [gemv(x, w, None, config) for w in weights], copies)
    cublas_us = graph_us(lambda: [F.linear(x, w) for w in weights], copies)
    return gemv_us, cublas_us


def main() -> int:
    from kvik.triton_kernels.gemv import gemv
    from kvik_cuda.tuning import gemv_config

    torch.manual_seed(0)
    records, summary = [], {}
    for name, (n, k) in SHAPES.items():
        config = gemv_config("sm90", n, k)
        copies = max(1, -(-4 * L2_BYTES // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda").bfloat16() * 0.02 for _ in range(copies)]
        best_rows = 0
        for m in ROWS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            out = gemv(x, weights[0], None, config)
            alone = torch.cat([gemv(x[r : r + 1], weights[0], None, config) for r in range(m)])
            ref = F.linear(x.float(), weights[0].float())
            error = ((out.float() - ref).norm() / ref.norm()).item()
            ok = torch.equal(out, alone) and error < 1e-2
            gemv_us, cublas_us = time_both(x, weights, config)
            if ok and gemv_us <= cublas_us and best_rows == m - 1:
                best_rows = m
            record = {"shape": name, "n": n, "k": k, "rows": m, "gemv_us": gemv_us,
                      "cublas_us": cublas_us, "correct": ok, "relative_error": error,
                      "gemv_of_bandwidth": 2 * n * k / (gemv_us * 1e-6) / 4.28e12}  # fmt: skip
            records.append(record)
            print(f"{name:8} rows {m}: GEMV {gemv_us:7.1f} us ({record['gemv_of_bandwidth']:5.1%} "
                  f"of 4.28 TB/s)  cuBLAS {cublas_us:7.1f} us  {'ok' if ok else 'WRONG'}",
                  flush=True)  # fmt: skip
        summary[name] = best_rows
        print(f"{name}: the GEMV is not slower up to {best_rows} rows", flush=True)
        weights = None
        torch.cuda.empty_cache()
    text = json.dumps({"records": records, "gemv_not_slower_up_to_rows": summary}, indent=1)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_rows_gpu.json").write_text(text + "\n")
    return 0 if all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
