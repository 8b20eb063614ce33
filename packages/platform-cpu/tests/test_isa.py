"""Choosing the CPU kernel path (kvik_cpu.isa): from the CPU's flags, or forced by KVIK_CPU_ISA,
with a clear error for a value that names no path and for a path the CPU or the build cannot run.
What each path then runs is tested on every path this CPU runs (tests/cpu_paths.py)."""

from __future__ import annotations

import os

import pytest

from kvik_cpu import isa
from kvik_cpu.isa import CpuIsa
from kvik_cpu.platform import CpuPlatform, has_native_bf16

AMX_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16"})
BF16_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
AVX2_CPU = frozenset({"avx", "avx2", "fma"})


@pytest.fixture
def cpu(monkeypatch):
    """cpu(flags): pretend the CPU lists these flags; KVIK_CPU_ISA starts unset."""
    monkeypatch.delenv(isa.ENV_VAR, raising=False)

    def pretend(flags: frozenset[str]) -> None:
        monkeypatch.setattr(isa, "cpu_flags", lambda: flags)

    return pretend


@pytest.mark.parametrize(
    "flags, best, dtype",
    [(AMX_CPU, CpuIsa.AMX, "bfloat16"), (BF16_CPU, CpuIsa.AVX512BF16, "bfloat16")]
    + [(AVX2_CPU, CpuIsa.PLAIN, "float32"), (frozenset(), CpuIsa.PLAIN, "float32")],
    ids=["amx", "avx512bf16", "avx2", "unknown"],
)
def test_unforced_the_cpu_flags_choose(cpu, flags, best, dtype):
    cpu(flags)
    assert isa.selected_isa() is best and isa.runnable_isas()[-1] is best
    assert has_native_bf16() == (best >= CpuIsa.AVX512BF16)
    assert CpuPlatform.default_dtype() == dtype
    details = CpuPlatform.details()
    assert details["kernel_path"] == best.label and details["amx"] == (best is CpuIsa.AMX)
    assert details["kernel_paths"] == [path.label for path in CpuIsa if path <= best]


@pytest.mark.parametrize("value", ["auto", "", " AUTO "])
def test_auto_is_unforced(cpu, monkeypatch, value):
    cpu(AMX_CPU)
    monkeypatch.setenv(isa.ENV_VAR, value)
    assert isa.forced_isa() is None and isa.selected_isa() is CpuIsa.AMX


@pytest.mark.parametrize("path", list(CpuIsa), ids=lambda p: p.label)
def test_any_path_at_or_below_the_cpus_runs_when_forced(cpu, monkeypatch, path):
    cpu(AMX_CPU)
    monkeypatch.setenv(isa.ENV_VAR, path.label.upper())
    assert isa.selected_isa() is path
    # The plain path is what a CPU without native bf16 runs: float32 unless asked.
    assert CpuPlatform.default_dtype() == ("float32" if path is CpuIsa.PLAIN else "bfloat16")
    assert CpuPlatform.details()["kernel_path"] == path.label


def test_a_value_that_names_no_path_is_refused_with_the_choices(cpu, monkeypatch):
    cpu(BF16_CPU)
    monkeypatch.setenv(isa.ENV_VAR, "avx2")
    with pytest.raises(ValueError, match="'avx2' is not a CPU kernel path: choose one of auto, "):
        isa.selected_isa()
    with pytest.raises(ValueError, match="KVIK_CPU_ISA"):
        CpuPlatform.default_dtype()
    assert CpuPlatform.details()["kernel_path"].startswith("error: KVIK_CPU_ISA='avx2'")


def test_a_path_the_cpu_lacks_is_refused_with_what_it_lacks(cpu, monkeypatch):
    cpu(BF16_CPU)
    monkeypatch.setenv(isa.ENV_VAR, "amx")
    with pytest.raises(
        ValueError, match=r"lacks \(amx_bf16, amx_tile\); it runs plain, avx512bf16"
    ):
        isa.selected_isa()
    cpu(AVX2_CPU)
    monkeypatch.setenv(isa.ENV_VAR, "avx512bf16")
    with pytest.raises(ValueError, match=r"lacks \(avx512_bf16\); it runs plain$"):
        isa.selected_isa()


def test_the_build_bounds_the_path(cpu, monkeypatch, caplog):
    """AMX flags, but a build (or a Linux) that cannot use the tiles: unforced, the engine takes the
    best path the build runs and says why; forced, it is an error."""
    cpu(AMX_CPU)
    assert isa.kernel_isa(CpuIsa.AMX) is CpuIsa.AMX
    assert isa.kernel_isa(CpuIsa.AVX512BF16) is CpuIsa.AVX512BF16
    assert "takes the avx512bf16 path" in caplog.text
    monkeypatch.setenv(isa.ENV_VAR, "amx")
    with pytest.raises(ValueError, match="KVIK_CPU_ISA=amx cannot run: this build .* up to avx5"):
        isa.kernel_isa(CpuIsa.AVX512BF16)
    # Without the C++ ops, the oneDNN packing still runs; AMX does not.
    with pytest.raises(ValueError, match="cannot run: kvik_cpu's C\\+\\+ ops did not build"):
        isa.kernel_isa(None)
    monkeypatch.setenv(isa.ENV_VAR, "avx512bf16")
    assert isa.kernel_isa(None) is CpuIsa.AVX512BF16


@pytest.mark.parametrize(
    "path, cap", [(CpuIsa.PLAIN, "AVX512_CORE"), (CpuIsa.AVX512BF16, "AVX512_CORE_BF16")]
)
def test_a_path_below_the_cpus_best_caps_onednn(cpu, monkeypatch, path, cap):
    cpu(AMX_CPU)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")  # so that monkeypatch restores its absence
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    isa.cap_onednn(CpuIsa.AMX)
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ  # the CPU's best: oneDNN chooses freely
    isa.cap_onednn(path)
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == cap
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the user's own cap stays
    isa.cap_onednn(path)
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_an_engine_on_a_path_the_cpu_lacks_fails_before_loading(cpu, monkeypatch):
    from kvik import LLM

    cpu(AVX2_CPU)
    monkeypatch.setenv(isa.ENV_VAR, "avx512bf16")
    with pytest.raises(ValueError, match="KVIK_CPU_ISA=avx512bf16 needs CPU features"):
        LLM(load_format="dummy")
