"""The fused MoE's launch configurations on NVIDIA GPUs: a JSON table per architecture and
expert shape (``fused_moe_configs.json``, written by tests/tune_fused_moe.py on the device), and a
rule for shapes the table does not hold.

A table row is keyed by token count; a step takes the row of the smallest count at or above its
own (the largest row past the end). Each row gives the gate/up and the down GEMM's
``[block_m, block_n, block_k, group_m, num_warps, num_stages]``, then optionally ``swap_ab``
(1: tiles computed transposed), ``paired`` (1: gate and up as one product) and ``half_rows`` (1:
an expert's last row block multiplied as half a block where its second half is padding), as
``MoeConfig`` has them, and last ``tma`` (the down row's 1: the down GEMM persistent with TMA
loads, the gate/up output stored in the aligned order; the gate/up row's 1: that GEMM persistent
with its weights by TMA, which no row sets: on an H100 it made the op slower at 2048-8192 tokens,
bf16 and block FP8). The bf16 gate/up rows for 4096 and 8192
tokens on sm90 (and 4096's down row) take half_rows from an H100's A/B of the whole op (2.7% and
1.0% faster; docs/benchmarks.md); the tuner sweeps it. ``tma`` comes from A/Bs of the whole op
(``KVIK_MOE_TMA=table``/``1`` against ``0`` with bench/moe_gpu.py; the tuner times each GEMM
apart, the down GEMM in its pointer form only). On an H200 (the fiftieth session) the TMA form
took 3-7% off the bf16 op at 2048, 4096, 4608 and 8192 tokens and 2-3% off block FP8's at 4096
and 8192 with wider down tiles than the pointer form's; those sm90 rows set it. (On an H100 the
bf16 4096 row lost with it; the table follows the H200. docs/benchmarks.md.)
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch

from kvik.triton_kernels.fused_moe import MoeConfig

TABLE = Path(__file__).with_name("fused_moe_configs.json")


@functools.cache
def _tables(path: Path = TABLE) -> dict[tuple[Any, ...], dict[int, tuple[MoeConfig, MoeConfig]]]:
    data = json.loads(path.read_text())
    tables = {}
    for table in data["tables"]:
        key = (
            table["arch"], table["experts"], table["intermediate"], table["hidden"],
            table["top_k"], table["dtype"],
        )  # fmt: skip
        tables[key] = {
            int(tokens): (MoeConfig(*row["up"]), MoeConfig(*row["down"]))
            for tokens, row in table["configs"].items()
        }
    return tables


def default_moe_config(num_tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> MoeConfig:
    """For shapes without a table row: 16-row tiles while an expert gets a few rows (decode), up
    to 64-row tiles with 128 columns when it gets many (prefill); fp32 takes shorter K steps so the
    tiles fit in shared memory, FP8 (a weight dtype of one byte) steps of 128, its scale groups."""
    rows_per_expert = num_tokens * top_k / experts
    if dtype.itemsize == 1:  # block-FP8 experts: one 128-wide scale group a K step
        if rows_per_expert <= 16:
            return MoeConfig(16, 64, 128, 1, 4, 4)
        if rows_per_expert <= 64:
            return MoeConfig(32, 64, 128, 8, 4, 4)
        return MoeConfig(64, 128, 128, 8, 8, 3)
    block_k = 32 if dtype == torch.float32 else 64
    if rows_per_expert <= 16:
        return MoeConfig(16, 64, 2 * block_k, 1, 4, 3)
    if rows_per_expert <= 64:
        return MoeConfig(32, 64, block_k, 8, 4, 3)
    return MoeConfig(64, 128, block_k, 8, 8, 3)


def fused_moe_config(
    arch: str, num_tokens: int, experts: int, inter: int, hidden: int, top_k: int, dtype
) -> tuple[MoeConfig, MoeConfig]:
    """The (gate/up, down) configurations on ``arch`` ("sm90", "sm100", ...)."""
    if not arch.startswith("sm"):
        raise ValueError(f"kvik_cuda configures NVIDIA architectures (sm*), not {arch!r}")
    dtype_name = str(dtype).removeprefix("torch.")
    rows = _tables().get((arch, experts, inter, hidden, top_k, dtype_name))
    if not rows:
        config = default_moe_config(num_tokens, experts, top_k, dtype)
        return config, config
    at_least = [t for t in sorted(rows) if t >= num_tokens]
    return rows[at_least[0] if at_least else max(rows)]


def dump_tables(data: dict[str, Any]) -> str:
    """The table file's text: indented JSON with each configuration on one line."""
    text = json.dumps(data, indent=1)
    # json.dumps puts every number of a list on a line of its own.
    return (
        re.sub(
            r"\[\s*([-\d,\s]+?)\s*\]",
            lambda m: "[" + ", ".join(n.strip() for n in m[1].split(",")) + "]",
            text,
        )
        + "\n"
    )
