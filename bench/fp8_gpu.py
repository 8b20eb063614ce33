"""The FP8 few-rows tensor-core kernel (``kvik.triton_kernels.fp8_skinny``, issue 14) on an NVIDIA
GPU, checked and then timed, in one run (budget: about 2 minutes on the H200, Triton compiles
included):

1. Correctness, first and for everything: Llama-3.1-8B's projections (qkv 6144x4096, o 4096x4096,
   gate_up 28672x4096, down 4096x14336) and LM head (128256x4096) at 1, 2, 4, 8, 16, 32 and 64
   rows, block scales (per token group of 128, 128x128 weight blocks) and per-channel scales, bf16
   activations with outlier columns and an all-zero row: the engine's product (``kvik_cuda.fp8``
   with the few-rows kernel on) against the PyTorch reference of the same numerics
   (``kvik.quantization.fp8_reference``), outputs poisoned with NaN first. A second call must give
   the same bits (split-K adds its partial sums in a fixed order) and the split-K counters must be
   back at zero. The kernels used before (``KVIK_FP8_SKINNY=0``: the CUDA-core GEMV up to 4 rows,
   the tiled kernel above, ``torch._scaled_mm`` for per-channel) are checked the same way.
2. Timing: every product in a CUDA graph, as the engine replays a decode step; one graph
   multiplies the activations by enough copies of the weight to exceed the 60 MB L2 four times, so
   every weight byte comes from memory. After the timing the graph is replayed once more on new
   activations into NaN-poisoned outputs and checked again (what a replayed decode step does).
   Printed: µs a product, GB/s of weight bytes read (e4m3 weight and its fp32 scales; bf16's two
   bytes a weight for bf16 ``F.linear`` on the same weights dequantized) and the share of the
   H200's 4.28 TB/s; a batch-1 step's weight products summed from the kernels' times; the FP8
   linear layer at M = 4096, N = K = 8192 against 1,451 TFLOP/s (issue 14: 60% block, 70%
   per-channel).

Run from the repository root (kvik installed, or with PYTHONPATH naming the packages' src):

    python3 bench/fp8_gpu.py                 # JSON to $OUT/fp8_gpu.json where $OUT is set
    python3 bench/fp8_gpu.py --out f.json    # or to f.json; --sweep: other tilings at one row
    python3 bench/fp8_gpu.py --rows 1,16,64  # fewer row counts; --budget-s: when timing stops

Block-FP8 launches for 1 to 16 rows (issue 14's batch-1 goal) are swept by
``bench/fp8_few_rows_gpu.py``, which prints ``kvik_cuda.tuning.FP8_BLOCK_FEW_ROWS``'s table.

A failed check is printed with FAIL on its line and again in a banner at the end, and the script
exits 1 (the JSON is written first). Where the few-rows kernel fails, ``KVIK_FP8_SKINNY=0`` in the
engine's environment sends those products back to the kernels used before it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import triton

import kvik_cuda.fp8
from kvik.bench.common import git_commit
from kvik.quantization import fp8_reference
from kvik.triton_kernels.fp8_linear import fp8_block_linear
from kvik.triton_kernels.fp8_skinny import Fp8SkinnyConfig, split_counters
from kvik_cuda import tuning

PEAK_BYTES_PER_S = 4.28e12  # the H200's measured copy bandwidth (KERNELS.md)
PEAK_FP8_FLOPS = 1451e12  # torch._scaled_mm e4m3 on the H200
L2_BYTES = 60 * 2**20
DEVICE = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
LAYERS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
LLAMA_8B_LAYERS = 32
ROWS = (1, 2, 4, 8, 16, 32, 64)
SCHEMES = ("block", "channel")
NEW, OLD, BF16 = "fp8 few-rows (new)", "fp8 before (KVIK_FP8_SKINNY=0)", "bf16 F.linear"
LARGE = (4096, 8192, 8192)
# The kernels and the reference quantize the activations alike (bit for bit); the sums differ in
# order and Hopper's fp8 MMA adds a group's 128 products with fewer bits than fp32. Outputs are
# bf16: one rounding step (2**-8 relative) apart at most where the two fp32 sums straddle one,
# so a correct kernel stays far below these (the GPU tests' bf16 bound), while a lost K group
# (~1/sqrt(groups) of a value), a wrong scale or an unwritten tile exceeds them many times.
REL_NORM_TOLERANCE = 1e-2
# Of |ref| plus the same share of ref's root mean square. Per-channel products keep the whole K
# sum in the MMA's accumulator (block products bring each 128-wide group back to fp32 with its
# scales), so their sums carry more of its rounding: the seventh session measured per-channel
# worst elements at 1.0-1.9x the block bound for the new and the old kernels alike, to 3 digits.
ELEMENT_TOLERANCE = {"block": 2e-2, "channel": 4e-2}
REPLAYS = 25
Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def few_rows_kernel(on: bool) -> Iterator[None]:
    """The routing ``KVIK_FP8_SKINNY`` sets, switched for the products made inside."""
    before = tuning.FP8_SKINNY
    tuning.FP8_SKINNY = on
    try:
        yield
    finally:
        tuning.FP8_SKINNY = before


def engine_product(scheme: str, skinny: bool) -> Product:
    """The product as the model calls it (``kvik_cuda.fp8``; configuration chosen per call)."""

    def block(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        with few_rows_kernel(skinny):
            return kvik_cuda.fp8.fp8_block_linear(x, w, s, None)

    def channel(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        with few_rows_kernel(skinny):
            return kvik_cuda.fp8.fp8_scaled_linear(x, w, s, None, None)

    return block if scheme == "block" else channel


def chosen_config(arch: str, scheme: str, skinny: bool, m: int, n: int, k: int) -> str:
    with few_rows_kernel(skinny):
        choose = tuning.fp8_block_config if scheme == "block" else tuning.fp8_scaled_config
        return repr(choose(arch, m, n, k))


def reference(scheme: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if scheme == "block":
        return fp8_reference.fp8_block_linear(x, w, s)
    return fp8_reference.fp8_scaled_linear(x, w, s)


def fp8_weight(n: int, k: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight [n, k] over most of e4m3's range, and its scales: block
    [n/128, k/128] or per channel [n]."""
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=DEVICE)
    for start in range(0, n, 8192):  # in slices: the fp32 draw of a whole LM head is 2 GB
        rows = weight[start : start + 8192]
        rows.copy_((torch.randn(rows.shape, device=DEVICE) * 100).clamp(-448, 448))
    if scheme == "channel":
        scale = torch.rand(n, device=DEVICE) * 1e-3 + 1e-4
    else:
        scale = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=DEVICE) * 1e-3 + 1e-4
    return weight, scale


def activations(m: int, k: int) -> torch.Tensor:
    """bf16 rows with outlier columns (groups of very different scales) and, from 4 rows, an
    all-zero row (its scales take the floor)."""
    x = torch.randn(m, k, device=DEVICE) * 3
    x[:, :: max(1, k // 7)] *= 50
    if m >= 4:
        x[1] = 0
    return x.to(torch.bfloat16)


def dequantized_bf16(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=DEVICE)
    for start in range(0, n, 8192):
        rows = weight[start : start + 8192].float()
        block = scale[start // 128 : triton.cdiv(start + rows.shape[0], 128)]
        rows *= fp8_reference.expand_block_scales(block, rows.shape[0], k)
        out[start : start + 8192] = rows
    return out


def poison_allocator() -> None:
    """Fill freed device memory with NaN, so outputs the launchers allocate start poisoned."""
    torch.full((1 << 28,), float("nan"), device=DEVICE)
    torch.cuda.synchronize()


def compare(out: torch.Tensor, ref: torch.Tensor, scheme: str) -> dict[str, Any]:
    """Relative norm error, the worst element against the tolerance, and the verdict."""
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape:
        return {"ok": False, "why": f"shape {tuple(out.shape)} != {tuple(ref.shape)}"}
    unwritten = int((~torch.isfinite(out)).sum().item())
    if unwritten:
        return {"ok": False, "why": f"{unwritten} of {out.numel()} outputs NaN or inf"}
    rms = ref.square().mean().sqrt().clamp(min=1e-30)
    diff = (out - ref).abs()
    rel = (diff.norm() / ref.norm().clamp(min=1e-30)).item()
    worst = (diff / (ELEMENT_TOLERANCE[scheme] * (ref.abs() + rms))).max().item()  # <= 1 passes
    ok = rel <= REL_NORM_TOLERANCE and worst <= 1.0
    result: dict[str, Any] = {"ok": ok, "rel_err": rel, "worst_over_tolerance": worst}
    if not ok:
        result["why"] = f"relative error {rel:.2e}, worst element {worst:.1f}x its tolerance"
    return result


def counters_zero() -> bool:
    return not split_counters(DEVICE).any().item()


def check_product(
    product: Product, x: torch.Tensor, w, s, ref: torch.Tensor, scheme: str
) -> dict[str, Any]:
    """The product against the reference on poisoned outputs; a second call with equal bits; the
    split-K counters left at zero."""
    poison_allocator()
    first = product(x, w, s)
    result = compare(first, ref, scheme)
    second = product(x, w, s)
    torch.cuda.synchronize()
    if result["ok"] and not torch.equal(first, second):
        result |= {"ok": False, "why": "a second call gave other bits"}
    if result["ok"] and not counters_zero():
        result |= {"ok": False, "why": "split-K counters left non-zero"}
    return result


def correctness(arch: str, rows: list[int], failures: list) -> list[dict]:
    records = []
    for seed, (scheme, (layer, (n, k))) in enumerate(itertools.product(SCHEMES, LAYERS.items())):
        torch.manual_seed(seed)
        w, s = fp8_weight(n, k, scheme)
        for m in rows:
            x = activations(m, k)
            ref = reference(scheme, x, w, s)
            for kernel, skinny in ((NEW, True), (OLD, False)):
                record = {"scheme": scheme, "layer": layer, "n": n, "k": k, "m": m,
                          "kernel": kernel, "config": chosen_config(arch, scheme, skinny,
                                                                      m, n, k)}  # fmt: skip
                if skinny and "Fp8SkinnyConfig" not in record["config"]:
                    # The routing sends these rows elsewhere (kvik_cuda.tuning): the "new" row
                    # would repeat the old one, so it is left out rather than failed.
                    record |= {"ok": True, "skipped": "the tuning routes these rows elsewhere"}
                else:
                    try:
                        record |= check_product(
                            engine_product(scheme, skinny), x, w, s, ref, scheme
                        )
                    except Exception as error:  # noqa: BLE001  (recorded; the run goes on)
                        record |= {"ok": False, "why": f"{type(error).__name__}: {error}"}
                records.append(record)
                if not record["ok"]:
                    failures.append(record)
                verdict = "ok" if record["ok"] else f"FAIL: {record['why'][:150]}"
                if "skipped" in record:
                    verdict = f"skipped: {record['skipped']}"
                print(f"check {scheme:7} {layer:8} m={m:<3} {kernel:32} "
                      f"{record.get('rel_err', float('nan')):8.1e} {verdict}")  # fmt: skip
        del w, s
        torch.cuda.empty_cache()
    return records


def graph_us(call: Callable[[], list], copies: int) -> tuple[float, torch.cuda.CUDAGraph, list]:
    """µs a product: ``call`` multiplies by ``copies`` weights; it runs eagerly first (Triton
    compiles, cuBLAS picks its algorithms), then in a CUDA graph replayed ``REPLAYS`` times."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call()
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
    return statistics.median(times) * 1e3 / copies, graph, outs


def replay_check(scheme, graph, outs, x, w, s) -> dict[str, Any]:
    """The captured graph on new activations (copied into its input) into poisoned outputs."""
    fresh = activations(*x.shape)
    x.copy_(fresh)
    outs[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    result = compare(outs[0], reference(scheme, fresh, w, s), scheme)
    if result["ok"] and not counters_zero():
        result |= {"ok": False, "why": "split-K counters left non-zero by the graph"}
    return result


def timed(record: dict, weight_bytes: int, us: float) -> dict:
    gbps = weight_bytes / (us * 1e-6) / 1e9
    return record | {"us": us, "gb_per_s": gbps, "of_bandwidth": gbps * 1e9 / PEAK_BYTES_PER_S}


def print_timing(record: dict) -> None:
    note = "" if record.get("replay_ok", True) else f"  FAIL on replay: {record['why'][:120]}"
    print(f"time  {record['scheme']:7} {record['layer']:8} m={record['m']:<3} "
          f"{record['kernel']:32} {record['us']:8.1f} µs {record['gb_per_s']:6.0f} GB/s "
          f"{record['of_bandwidth']:6.1%}{note}")  # fmt: skip


def timing(rows: list[int], sweep: bool, deadline: float, failures: list) -> list[dict]:
    records = []
    for seed, (scheme, layer) in enumerate(itertools.product(SCHEMES, LAYERS)):
        if time.time() > deadline:
            print(f"time  {scheme} {layer}: skipped, past the time budget")
            continue
        torch.manual_seed(100 + seed)
        records += time_layer(scheme, layer, rows, sweep, failures)
        torch.cuda.empty_cache()
    return records


def walk(product: Product, x: torch.Tensor, weights: list) -> Callable[[], list]:
    """A call that multiplies ``x`` by each (weight, scale) of ``weights``."""
    return lambda: [product(x, w, s) for w, s in weights]


def time_layer(scheme: str, layer: str, rows: list[int], sweep: bool, failures: list) -> list[dict]:
    """A layer's products at every row count, and bf16's (once a layer, on the block weights
    dequantized)."""
    n, k = LAYERS[layer]
    weights = [fp8_weight(n, k, scheme)]
    fp8_bytes = n * k + weights[0][1].numel() * 4
    copies = max(1, triton.cdiv(4 * L2_BYTES, fp8_bytes))
    weights += [fp8_weight(n, k, scheme) for _ in range(copies - 1)]
    bf16 = []
    if scheme == "block":
        bf16_copies = max(1, triton.cdiv(4 * L2_BYTES, 2 * n * k))
        bf16 = [(dequantized_bf16(*weights[i % copies]), None) for i in range(bf16_copies)]
    records = []
    for m in rows:
        x = activations(m, k)
        products = {NEW: engine_product(scheme, True), OLD: engine_product(scheme, False)}
        if sweep and m == 1 and scheme == "block" and layer in PROJECTIONS:
            for name, config in sweep_configs(n, k).items():
                products[f"sweep {name}"] = sweep_product(config)
        for kernel, product in products.items():
            record = {"scheme": scheme, "layer": layer, "n": n, "k": k, "m": m, "kernel": kernel}
            try:
                us, graph, outs = graph_us(walk(product, x, weights), copies)
                record = timed(record, fp8_bytes, us)
                replay = replay_check(scheme, graph, outs, x, *weights[0])
                record["replay_ok"] = replay["ok"]
                if not replay["ok"]:
                    record["why"] = replay["why"]
                    failures.append(record)
                print_timing(record)
            except Exception as error:  # noqa: BLE001  (recorded; the run goes on)
                record["error"] = f"{type(error).__name__}: {error}"[:300]
                failures.append(record)
                print(f"time  {scheme:7} {layer:8} m={m:<3} {kernel:32} ERROR {record['error']}")
            records.append(record)
        if bf16:
            record = {"scheme": "bf16", "layer": layer, "n": n, "k": k, "m": m, "kernel": BF16}
            us, _, _ = graph_us(walk(lambda x, w, s: F.linear(x, w), x, bf16), len(bf16))
            records.append(timed(record, 2 * n * k, us))
            print_timing(records[-1])
    return records


def sweep_configs(n: int, k: int) -> dict[str, Fp8SkinnyConfig]:
    """Other few-rows tilings at one row, for kvik_cuda.tuning."""
    split = tuning.skinny_split(n, k)
    return {
        "n128 s4": Fp8SkinnyConfig(128, split, 4, 4),
        "n128 prequant": Fp8SkinnyConfig(128, split, 4, 3, quantize=False),
        "n64 split x2": Fp8SkinnyConfig(64, min(16, split * 2), 4, 3),
        "n256 w8 split /2": Fp8SkinnyConfig(256, max(1, split // 2), 8, 3),
    }


def sweep_product(config: Fp8SkinnyConfig) -> Product:
    return lambda x, w, s: fp8_block_linear(x, w, s, None, config)


def batch_one_step(records: list[dict]) -> dict[str, Any]:
    """A batch-1 decode step's weight products of Llama-3.1-8B from the kernels' own times (no
    engine: other kernels and gaps come on top): 32 layers' four FP8 products and the bf16 LM
    head, against the weight-read floor."""

    def us(layer: str, kernel: str, scheme: str) -> float | None:
        for r in records:
            if (r["layer"], r["kernel"], r["scheme"], r["m"]) == (layer, kernel, scheme, 1):
                return r.get("us")
        return None

    head = us("lm_head", BF16, "bf16")
    result: dict[str, Any] = {"bf16_lm_head_us": head}
    for scheme in SCHEMES:
        for kernel in (NEW, OLD):
            layer_us = [us(layer, kernel, scheme) for layer in PROJECTIONS]
            if head is None or None in layer_us:
                continue
            step_us = LLAMA_8B_LAYERS * sum(layer_us) + head
            result[f"{scheme}: {kernel}"] = {
                "layer_us": dict(zip(PROJECTIONS, layer_us, strict=True)),
                "step_weight_products_ms": step_us / 1e3,
                "tok_per_s_if_nothing_else": 1e6 / step_us,
            }
    floor_bytes = LLAMA_8B_LAYERS * sum(n * k for n, k in (LAYERS[p] for p in PROJECTIONS))
    floor_bytes += 2 * LAYERS["lm_head"][0] * LAYERS["lm_head"][1]
    result |= {"weight_bytes": floor_bytes, "floor_ms": floor_bytes / PEAK_BYTES_PER_S * 1e3}
    return result


def large(failures: list) -> list[dict]:
    """The FP8 linear layer as the model calls it at M = 4096, N = K = 8192."""
    m, n, k = LARGE
    torch.manual_seed(2)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    records = []
    for scheme in SCHEMES:
        w, s = fp8_weight(n, k, scheme)
        product = engine_product(scheme, True)
        record = {"scheme": scheme, "m": m, "n": n, "k": k,
                  "target": 0.6 if scheme == "block" else 0.7}  # fmt: skip
        record |= compare(product(x, w, s), reference(scheme, x, w, s), scheme)
        ms = triton.testing.do_bench(lambda: product(x, w, s), warmup=25, rep=200)  # noqa: B023
        tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
        record |= {"ms": ms, "tflops": tflops, "of_peak": tflops * 1e12 / PEAK_FP8_FLOPS}
        if not record["ok"]:
            failures.append(record)
        records.append(record)
        print(f"large {scheme:7} M={m} N={n} K={k}: {ms:.3f} ms {tflops:6.0f} TFLOP/s "
              f"{record['of_peak']:6.1%} of 1451 (issue 14: {record['target']:.0%})"
              f"{'' if record['ok'] else '  FAIL: ' + record['why']}")  # fmt: skip
    return records


def banner(failures: list[dict]) -> None:
    if not failures:
        print("\nALL CHECKS PASSED")
        return
    line = "!" * 100
    print(f"\n{line}\n{len(failures)} CHECKS FAILED:")
    for f in failures:
        what = f.get("why") or f.get("error")
        print(f"  FAIL {f.get('scheme')} {f.get('layer', '')} m={f.get('m')} "
              f"{f.get('kernel', '')}: {what}")  # fmt: skip
    if any(f.get("kernel") == NEW for f in failures):
        print("The few-rows kernel is WRONG on this GPU for the products above: run the engine "
              "with KVIK_FP8_SKINNY=0 (the kernels used before) until it is fixed.")  # fmt: skip
    print(line)


def row_counts(text: str) -> list[int]:
    rows = [int(part) for part in text.split(",") if part.strip()]
    if not rows or any(not 1 <= m <= 64 for m in rows):
        raise argparse.ArgumentTypeError(f"row counts from 1 to 64, comma-separated, not {text!r}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "fp8_gpu.json") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out, help="the JSON file ($OUT/fp8_gpu.json)")
    parser.add_argument("--sweep", action="store_true", help="other few-rows tilings at M = 1")
    parser.add_argument("--rows", type=row_counts, default=list(ROWS),
                        help="row counts, comma-separated (default 1,2,4,8,16,32,64)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=135.0,
                        help="skip the remaining timings past this many seconds")  # fmt: skip
    args = parser.parse_args()
    started = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False  # the references' fp32 products stay fp32
    props = torch.cuda.get_device_properties(DEVICE)
    arch = kvik_cuda.fp8.arch_of(DEVICE)
    print(f"{props.name}, {arch}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}, KVIK_FP8_SKINNY in the environment: "
          f"{os.environ.get('KVIK_FP8_SKINNY', '(unset)')}")  # fmt: skip
    failures: list[dict] = []
    checks = correctness(arch, args.rows, failures)
    checked_s = time.time() - started
    print(f"correctness: {sum(r['ok'] for r in checks)} of {len(checks)} ok in {checked_s:.0f} s")
    records = timing(args.rows, args.sweep, started + args.budget_s - 10, failures)
    step = batch_one_step(records)
    print("batch-1 step, weight products only:", json.dumps(step, indent=1))
    large_records: list[dict] = []
    if time.time() < started + args.budget_s:
        try:
            large_records = large(failures)
        except Exception as error:  # noqa: BLE001  (recorded; the JSON is still written)
            failures.append({"scheme": "large", "error": f"{type(error).__name__}: {error}"})
    banner(failures)
    result = {
        "device": props.name, "arch": arch, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
        "peak_bytes_per_s": PEAK_BYTES_PER_S, "peak_fp8_flops": PEAK_FP8_FLOPS,
        "checks": checks, "timings": records, "batch1_step": step, "large": large_records,
        "failures": failures, "seconds": time.time() - started,
    }  # fmt: skip
    return finish(result, args.out, failures, started)


def finish(result: dict[str, Any], out: str | None, failures: list, started: float) -> int:
    """Write the run's JSON (if ``out``), print the failure count; the exit status (1: failures)."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"JSON in {out}")
    print(f"{len(failures)} failures; {time.time() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
