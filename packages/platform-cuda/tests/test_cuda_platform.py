"""NVIDIA detection, tested by faking what NVML and torch answer."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from kvik.platforms.base import MEMORY_UTILIZATION
from kvik.plugins.manager import KvikPluginManager
from kvik_cuda.platform import CudaPlatform

GiB = 1024**3


class FakeNvml:
    """Stands in for the ``pynvml`` module: GPUs as (name, capability, total, free)."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 (pynvml's name)
        pass

    def __init__(self, gpus: list[tuple[str, tuple[int, int], int, int]], init_error=None):
        self.gpus = gpus
        self.init_error = init_error
        self.open = 0

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_error is not None:
            raise self.init_error
        self.open += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:  # noqa: N802
        return self.gpus[handle][0]

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return f"GPU-{handle:04d}-aaaa"

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:  # noqa: N802
        return self.gpus[handle][1]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        _, _, total, free = self.gpus[handle]
        return SimpleNamespace(total=total, free=free, used=total - free)


H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB, 79 * GiB)
B200 = ("NVIDIA B200", (10, 0), 180 * GiB, 170 * GiB)


@pytest.fixture(autouse=True)
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build of torch that must not initialise CUDA while detecting."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def no_context() -> None:
        raise AssertionError("detection must not initialise CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_context)


def fake_nvml(monkeypatch: pytest.MonkeyPatch, *gpus, init_error=None) -> FakeNvml:
    nvml = FakeNvml(list(gpus), init_error)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_hopper_reports_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_nvml(monkeypatch, H100)
    assert CudaPlatform.is_present()
    [gpu] = CudaPlatform.details()["gpus"]
    assert gpu == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "capability": "9.0",
        "sm": "sm90",
        "generation": "Hopper",
        "total_memory_bytes": 80 * GiB,
        "free_memory_bytes": 79 * GiB,
    }
    assert CudaPlatform.device_capability() == (9, 0)
    assert CudaPlatform.total_memory_bytes() == 80 * GiB
    assert CudaPlatform.default_kv_cache_bytes(None) == int(79 * GiB * MEMORY_UTILIZATION)
    assert nvml.open == 0  # every nvmlInit had its nvmlShutdown


def test_default_max_num_seqs_follows_the_gpus_memory_without_a_cuda_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_nvml(monkeypatch, H100)
    assert CudaPlatform.default_max_num_seqs() == 512  # 80 GiB: at least vLLM's 70 GiB
    fake_nvml(monkeypatch, ("NVIDIA L4", (8, 9), 24 * GiB, 23 * GiB))
    assert CudaPlatform.default_max_num_seqs() == 256
    fake_nvml(monkeypatch, H100, init_error=FakeNvml.NVMLError("Driver Not Loaded"))
    assert CudaPlatform.default_max_num_seqs() == 256  # base rule when NVML fails


def test_default_max_num_batched_tokens_is_larger_offline_on_large_gpus_and_small_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_nvml(monkeypatch, H100)
    assert CudaPlatform.default_max_num_batched_tokens(serving=False) == 16384
    assert CudaPlatform.default_max_num_batched_tokens(serving=True) == 512
    fake_nvml(monkeypatch, ("NVIDIA L4", (8, 9), 24 * GiB, 23 * GiB))
    assert CudaPlatform.default_max_num_batched_tokens(serving=False) == 8192
    assert CudaPlatform.default_max_num_batched_tokens(serving=True) == 512
    fake_nvml(monkeypatch, H100, init_error=FakeNvml.NVMLError("Driver Not Loaded"))
    assert CudaPlatform.default_max_num_batched_tokens(serving=False) == 8192
    assert CudaPlatform.default_max_num_batched_tokens(serving=True) == 512


@pytest.mark.parametrize(
    ("capability", "sm", "generation"),
    [
        ((10, 0), "sm100", "Blackwell"),
        ((10, 3), "sm103", "Blackwell"),
        ((12, 0), "sm120", "Blackwell (consumer)"),
        ((8, 0), "sm80", "Ampere"),
        ((8, 9), "sm89", "Ada"),
        ((11, 7), "sm117", "unknown"),
    ],
)
def test_generation_names(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], sm: str, generation: str
) -> None:
    fake_nvml(monkeypatch, ("GPU", capability, 8 * GiB, 8 * GiB))
    [gpu] = CudaPlatform.details()["gpus"]
    assert (gpu["sm"], gpu["generation"]) == (sm, generation)


def test_nvml_failure_means_not_present(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, H100, init_error=FakeNvml.NVMLError("Driver Not Loaded"))
    assert not CudaPlatform.is_present()
    assert CudaPlatform.details()["error"] == "NVML: Driver Not Loaded"


def test_no_gpu_means_not_present(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch)
    assert not CudaPlatform.is_present()


def test_rocm_build_of_torch_leaves_the_gpus_to_kvik_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, H100)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert not CudaPlatform.is_present()


@pytest.mark.parametrize("count", [0, 2])
def test_without_nvml_library_torch_counts(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    fake_nvml(monkeypatch, init_error=FakeNvml.NVMLError_LibraryNotFound("no libnvidia-ml"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert CudaPlatform.is_present() == (count > 0)
    assert CudaPlatform.details()["nvml"] == "not available"


def test_without_pynvml_torch_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert CudaPlatform.is_present()


@pytest.mark.parametrize(
    ("visible", "indices"),
    [("1", [1]), ("1,0", [1, 0]), ("", []), ("-1", []), ("0,7,1", [0]), ("GPU-0001", [1])],
)
def test_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, indices: list[int]
) -> None:
    fake_nvml(monkeypatch, H100, B200)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [gpu["index"] for gpu in CudaPlatform.details().get("gpus", [])] == indices
    assert CudaPlatform.is_present() == bool(indices)


def test_config_check_refuses_a_torch_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="needs a CUDA build of torch"):
        CudaPlatform.check_and_update_config(None)


def test_platform_comes_through_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVIK_PLUGINS", "cuda")
    manager = KvikPluginManager()
    manager.load_entry_points()
    assert manager.platforms() == [("cuda", CudaPlatform)]
    assert CudaPlatform.name == "cuda" and CudaPlatform.priority == 100
    assert CudaPlatform.dist_backend == "nccl" and CudaPlatform.graph_support == "cuda_graphs"
    assert CudaPlatform.default_dtype() == "bfloat16"


def test_selected_cuda_registers_its_launch_configurations() -> None:
    """on_selected() hands the shared attention kernel Hopper's and Blackwell's configurations
    for "sm*", and TRITON_ATTN is core's shared backend."""
    from kvik.triton_kernels import TRITON_ATTENTION_BACKEND
    from kvik.triton_kernels.attention import attention_config
    from kvik_cuda import tuning

    CudaPlatform.on_selected()
    for arch in ("sm90", "sm100"):
        for args in [(128, 4, 1, torch.bfloat16), (256, 8, 512, torch.float32)]:
            assert attention_config(arch, *args) == tuning.attention_config(arch, *args)
    assert attention_config("sm90", 128, 4, 1, torch.bfloat16).num_stages == 3
    with pytest.raises(ValueError, match="NVIDIA architectures"):
        tuning.attention_config("gfx942", 128, 4, 1, torch.bfloat16)
    assert TRITON_ATTENTION_BACKEND.startswith("kvik.triton_kernels.attention:")


def test_h200_decode_plans_take_the_batches_past_a_wave() -> None:
    """The selected platform plans decode launches on the H200's SM count for Llama-8B's head
    layout over a 16-bit cache: 33 to 40 requests split in two with 2-stage tiles, 97 to 256 in
    32-key 2-stage tiles, every other batch, an FP8 cache, another SM count or head layout the
    defaults (num_kv_splits and the chooser's decode tiles)."""
    from kvik.triton_kernels.attention import decode_launch
    from kvik.triton_kernels.paged_attention import AttentionConfig, num_kv_splits
    from kvik_cuda import tuning

    CudaPlatform.on_selected()
    default = tuning.attention_config("sm90", 128, 4, 1, torch.bfloat16)

    def launch(num_reqs: int, dtype=torch.bfloat16, num_sms: int = 132, group: int = 4):
        return decode_launch("sm90", 128, group, dtype, num_reqs, 8, 131072, num_sms)

    for num_reqs in (33, 37, 40):
        assert launch(num_reqs) == (AttentionConfig(16, 64, 4, 2), 2)
    assert launch(48) == (AttentionConfig(16, 64, 4, 3), 1)
    assert launch(96) == (AttentionConfig(16, 32, 2, 3), 1)
    for num_reqs in (97, 128, 256):  # workload B's batch among them
        assert launch(num_reqs) == (AttentionConfig(16, 32, 2, 2), 1)
    for num_reqs in (1, 8, 32, 49, 64, 257, 512):
        assert launch(num_reqs) == (default, num_kv_splits(num_reqs, 8, 131072, 132))
    assert launch(40, dtype=torch.float8_e4m3fn) == (
        tuning.attention_config("sm90", 128, 4, 1, torch.float8_e4m3fn),
        1,
    )
    # Over an e4m3 cache: its own plan from 97 requests (workload B's 256 among them), and no
    # other entry of the 16-bit table.
    for num_reqs in (97, 128, 200, 256):
        assert launch(num_reqs, dtype=torch.float8_e4m3fn) == (AttentionConfig(16, 32, 2, 2), 1)
    fp8_default = tuning.attention_config("sm90", 128, 4, 1, torch.float8_e4m3fn)
    for num_reqs in (1, 64, 96, 257):
        assert launch(num_reqs, dtype=torch.float8_e4m3fn) == (
            fp8_default,
            num_kv_splits(num_reqs, 8, 131072, 132),
        )
    assert launch(40, num_sms=114) == (default, 1)  # H100 PCIe: its waves end elsewhere
    assert launch(40, group=8)[1] == 1
    # Every planned configuration compiles where it must (test_triton_kernels_compile.py).
    plans = [*tuning.H200_DECODE_PLANS.values(), *tuning.H200_FP8_DECODE_PLANS.values()]
    assert {config.block_m for config, _ in plans} == {16}


def test_fp32_wide_heads_avoid_the_spilling_variants() -> None:
    """fp32 heads of 128 and 256 take the measured FP32_WIDE_ROWS entries, prompts and decodes
    alike, on Hopper and Blackwell; bf16 heads of 256, fp16/bf16 heads of 128 and an e4m3 cache
    under fp32 queries keep the general rules."""
    from kvik.triton_kernels.paged_attention import AttentionConfig
    from kvik_cuda import tuning

    for arch in ("sm90", "sm100"):
        for group in (1, 2, 4, 8):
            config = tuning.attention_config
            assert config(arch, 128, group, 512, torch.float32) == AttentionConfig(64, 32, 8, 2)
            assert config(arch, 256, group, 512, torch.float32) == AttentionConfig(64, 64, 8, 2)
            decode_rows = max(16, group)
            assert config(arch, 128, group, 1, torch.float32) == AttentionConfig(
                decode_rows, 64, 4, 2
            )
            assert config(arch, 256, group, 1, torch.float32) == AttentionConfig(
                decode_rows, 32, 2, 2
            )
            assert config(arch, 256, group, 512, torch.bfloat16) == AttentionConfig(64, 32, 4, 2)
        assert tuning.attention_config(arch, 128, 4, 1, torch.float8_e4m3fn) == (
            tuning.attention_config(arch, 128, 4, 1, torch.bfloat16)
        )
        assert tuning.attention_config(arch, 64, 4, 512, torch.float32) == AttentionConfig(
            64, 32, 4, 2
        )


def test_fp32_queries_over_an_e4m3_cache_take_their_own_tiles() -> None:
    """With the queries' dtype (the backend passes it), fp32 queries over an e4m3 cache take
    FP32_OVER_E4M3's tiles, 16-bit ones the measured e4m3 tiles and plans as before; the H200's
    decode plans (measured for 16-bit queries) stand aside for fp32 ones."""
    from kvik.triton_kernels.attention import attention_config, decode_launch
    from kvik.triton_kernels.paged_attention import AttentionConfig
    from kvik_cuda import tuning

    CudaPlatform.on_selected()
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    for arch in ("sm90", "sm100"):
        assert attention_config(arch, 128, 4, 1, e4m3, f32) == AttentionConfig(16, 32, 4, 2)
        assert attention_config(arch, 256, 2, 1, e4m3, f32) == AttentionConfig(16, 32, 4, 2)
        assert attention_config(arch, 128, 4, 512, e4m3, f32) == AttentionConfig(64, 16, 8, 2)
        assert attention_config(arch, 256, 2, 512, e4m3, f32) == attention_config(
            arch, 256, 2, 512, e4m3
        )  # no candidate left the fallback: the general rule
        for queries in (None, torch.bfloat16, torch.float16):
            assert attention_config(arch, 128, 4, 1, e4m3, queries) == AttentionConfig(16, 64, 2, 3)
    planned = decode_launch("sm90", 128, 4, e4m3, 128, 8, 131072, 132, torch.bfloat16)
    assert planned == tuning.decode_plan("sm90", 128, 4, e4m3, 128 * 8, 132)
    assert decode_launch("sm90", 128, 4, e4m3, 128, 8, 131072, 132, f32) == (
        AttentionConfig(16, 32, 4, 2),
        1,
    )
    assert tuning.decode_plan("sm90", 128, 4, e4m3, 128 * 8, 132, query_dtype=f32) is None


def test_block_fp8_experts_get_their_kernel_and_tiles() -> None:
    """kvik::fused_moe_fp8_block runs kvik_cuda's Triton kernel on CUDA tensors, and every
    configuration chosen for e4m3 experts keeps each K step inside one 128-wide scale group."""
    from kvik.triton_kernels.fused_moe import fused_moe_fp8_block
    from kvik_cuda.moe_tuning import fused_moe_config
    from kvik_cuda.registration import KERNELS

    assert KERNELS["kvik::fused_moe_fp8_block"] is fused_moe_fp8_block
    for tokens in (1, 8, 64, 512, 4096, 65536):
        for experts, inter, hidden, top_k in [(128, 768, 2048, 8), (8, 14336, 4096, 2)]:
            for config in fused_moe_config(
                "sm90", tokens, experts, inter, hidden, top_k, torch.float8_e4m3fn
            ):
                assert 128 % config.block_k == 0


def test_moe_table_rows_take_optional_swap_paired_and_half_rows_entries(tmp_path) -> None:
    """A table row is six integers, then optionally swap_ab, paired and half_rows; the tuning
    script writes them up to the last one set; every row of the packaged table that is swapped
    has the shapes a swapped tile needs, and every half_rows row blocks of 64 rows or more."""
    import importlib.util
    import json
    from pathlib import Path

    from kvik.triton_kernels.fused_moe import MoeConfig
    from kvik_cuda.moe_tuning import TABLE, _tables

    data = {"tables": [{
        "arch": "sm90", "experts": 4, "intermediate": 64, "hidden": 128, "top_k": 2,
        "dtype": "bfloat16",
        "configs": {
            "1": {"up": [16, 64, 64, 1, 4, 3, 1, 1], "down": [16, 32, 64, 1, 4, 3]},
            "64": {"up": [64, 64, 64, 1, 4, 3, 0, 1, 1], "down": [128, 64, 64, 1, 8, 3, 0, 0, 1]},
        },
    }]}  # fmt: skip
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    rows = _tables(path)[("sm90", 4, 64, 128, 2, "bfloat16")]
    up, down = rows[1]
    assert (up.swap_ab, up.paired, up.half_rows, down.swap_ab, down.paired) == (1, 1, 0, 0, 0)
    up, down = rows[64]
    assert (up.paired, up.half_rows, down.paired, down.half_rows) == (1, 1, 0, 1)
    for rows in _tables(TABLE).values():
        for config in (c for pair in rows.values() for c in pair):
            assert not config.swap_ab or (config.block_m <= 32 and config.block_n % 64 == 0)
            assert not config.half_rows or config.block_m >= 64
        # use_tma_down passes over a tma row whose gate/up GEMM aligns to another block_m.
        assert all(not down.tma or up.block_m == down.block_m for up, down in rows.values())
    script = Path(__file__).with_name("tune_fused_moe.py")
    spec = importlib.util.spec_from_file_location("tune_fused_moe", script)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    for row in ([64, 64, 64, 1, 4, 3], [16, 64, 64, 1, 4, 3, 1], [64, 64, 64, 1, 4, 3, 0, 0, 1]):
        assert tune.table_row(MoeConfig(*row)) == row
        assert tune.parse_configs(",".join(map(str, row))) == [MoeConfig(*row)]
    with pytest.raises(ValueError, match="half_rows"):
        MoeConfig(16, 64, 64, 1, 4, 3, 0, 0, 1)
