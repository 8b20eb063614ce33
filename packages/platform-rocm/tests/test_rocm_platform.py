"""AMD detection, tested by faking what a ROCm build of torch answers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvik.plugins.manager import KvikPluginManager
from kvik_rocm.platform import RocmPlatform, describe_gpu

GiB = 1024**3


def fake_rocm(
    monkeypatch: pytest.MonkeyPatch, hip: str | None, names: list[str], arch: str
) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))

    def properties(index: int) -> SimpleNamespace:
        if hip is None:
            raise AssertionError("a CUDA build's GPUs are not kvik_rocm's to query")
        return SimpleNamespace(name=names[index], gcnArchName=arch, total_memory=192 * GiB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)


def test_mi300x_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rocm(monkeypatch, "6.4.0", ["AMD Instinct MI300X"] * 8, "gfx942:sramecc+:xnack-")
    assert RocmPlatform.is_present()
    details = RocmPlatform.details()
    assert details["torch_hip"] == "6.4.0"
    assert len(details["gpus"]) == 8
    assert details["gpus"][0] == {
        "index": 0,
        "name": "AMD Instinct MI300X",
        "arch": "gfx942",
        "product": "MI300X",
        "generation": "CDNA3",
        "total_memory_bytes": 192 * GiB,
    }


@pytest.mark.parametrize(
    ("name", "arch", "product", "generation"),
    [
        ("AMD Instinct MI325X", "gfx942:sramecc+:xnack-", "MI325X", "CDNA3"),
        ("AMD Instinct MI300A", "gfx942", "MI300A", "CDNA3"),
        ("AMD Radeon Graphics", "gfx942:sramecc+:xnack-", "MI300 series", "CDNA3"),
        ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", "MI250X", "CDNA2"),
        ("AMD Instinct MI355X", "gfx950", "MI355X", "CDNA4"),
        ("AMD Radeon RX 7900 XTX", "gfx1100", "unknown", "unknown"),
    ],
)
def test_cdna_parts(name: str, arch: str, product: str, generation: str) -> None:
    gpu = describe_gpu(name, arch)
    assert (gpu["arch"], gpu["product"], gpu["generation"]) == (
        arch.split(":")[0],
        product,
        generation,
    )


def test_cuda_build_of_torch_is_not_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rocm(monkeypatch, None, ["NVIDIA H100"], "")
    assert not RocmPlatform.is_present()
    assert RocmPlatform.details() == {"torch_hip": None}


def test_rocm_build_without_a_gpu_is_not_present(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_rocm(monkeypatch, "6.4.0", [], "")
    assert not RocmPlatform.is_present()


def test_platform_comes_through_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVIK_PLUGINS", "rocm")
    manager = KvikPluginManager()
    manager.load_entry_points()
    assert manager.platforms() == [("rocm", RocmPlatform)]
    assert RocmPlatform.device_type == "cuda"  # torch's device type on ROCm
    assert (RocmPlatform.dist_backend, RocmPlatform.priority) == ("nccl", 100)


def test_triton_attention_is_registered_without_kvik_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvik-rocm alone registers TRITON_ATTN (core's shared backend); beside kvik-cuda, both
    register the same target and neither is refused."""
    monkeypatch.setenv("KVIK_PLUGINS", "rocm")
    manager = KvikPluginManager()
    manager.load_entry_points()
    assert manager.errors == []
    assert manager.attention_backends.owners == {"TRITON_ATTN": "rocm"}
    backend = manager.attention_backends.resolve("TRITON_ATTN")
    assert backend.name == "TRITON_ATTN" and backend.__module__ == "kvik.triton_kernels.attention"

    monkeypatch.setenv("KVIK_PLUGINS", "cuda,rocm")
    both = KvikPluginManager()
    both.load_entry_points()
    assert both.errors == [] and both.attention_backends.names() == ["TRITON_ATTN"]


def test_selected_rocm_registers_its_launch_configurations() -> None:
    """on_selected() hands the shared attention kernel MI300X's configurations for "gfx*"."""
    from kvik.triton_kernels.attention import attention_config
    from kvik_rocm import tuning

    RocmPlatform.on_selected()
    for args in [(128, 4, 1, torch.bfloat16), (256, 8, 512, torch.float32)]:
        assert attention_config("gfx942", *args) == tuning.attention_config("gfx942", *args)
    assert attention_config("gfx942", 128, 4, 1, torch.bfloat16).tile_n == 32
    with pytest.raises(ValueError, match="AMD architectures"):
        tuning.attention_config("sm90", 128, 4, 1, torch.bfloat16)
