"""The Platform interface: everything kvik's core needs to know about a kind of hardware."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvik.config import EngineConfig, OpsDispatch
    from kvik.quantization.kernels import LinearKernel
    from kvik.worker.step_runner import StepRunner


class StepGraphs(Protocol):
    """Replayable device work, one graph per key: ``run(key, fn)`` captures what ``fn`` queues
    (on persistent buffers only) the first time a key is seen, and replays it after. For work
    outside the model's step (EAGLE-3's draft steps)."""

    def run(self, key: Hashable, fn: Callable[[], None]) -> None: ...


#: The share of a device's free memory the KV cache gets by default (vLLM's gpu_memory_utilization).
MEMORY_UTILIZATION = 0.9

#: ``max_num_seqs`` when none is given; on devices of at least LARGE_DEVICE_BYTES (vLLM's
#: threshold, 70 GiB), LARGE_DEVICE_MAX_NUM_SEQS. vLLM's offline engine takes 1024 there; on the
#: H200 kvik measured 512 best (Qwen3-30B-A3B, 1000 x (1024 in, 128 out): 43,654 total tok/s at
#: 512, 38,237 at 256, 38,058 at 1024, where the KV cache holds ~620 such sequences and the rest
#: are preempted; a later default run gave 36,953, cause unknown: docs/benchmarks.md, the
#: seventeenth session).
DEFAULT_MAX_NUM_SEQS = 256
LARGE_DEVICE_MAX_NUM_SEQS = 512
LARGE_DEVICE_BYTES = 70 * 2**30


def max_num_seqs_for_memory(total_bytes: int) -> int:
    """The default ``max_num_seqs`` for a device of ``total_bytes``: more sequences a step where
    the memory holds their KV cache, so that a decode step's weight reads serve more of them."""
    return LARGE_DEVICE_MAX_NUM_SEQS if total_bytes >= LARGE_DEVICE_BYTES else DEFAULT_MAX_NUM_SEQS


#: ``max_num_batched_tokens`` when none is given (and chunked prefill is on). Offline runs (the
#: ``LLM`` class, ``kvik bench throughput``) on devices of at least LARGE_DEVICE_BYTES take
#: LARGE_DEVICE_OFFLINE_MAX_NUM_BATCHED_TOKENS, as vLLM's offline engine does there. On the H200,
#: 1000 x (1024 in, 128 out) ran 12.7% faster at 16384 on Qwen3-30B-A3B (45,887 total tok/s
#: against 40,701: more tokens a step fill the experts' grouped GEMMs) and 1.3% on Llama-3.1-8B
#: (docs/benchmarks.md, the nineteenth session).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
LARGE_DEVICE_OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384
#: A server on a GPU takes small steps instead (vLLM's V0 default with chunked prefill): a
#: prompt runs in chunks of what the running requests leave of 512 tokens, each in a step that
#: also gives every running request its next token, where a whole 1024-token prompt would stall
#: them all for a ~25 ms step; and every such step fits the largest piecewise CUDA graph (512
#: tokens), so none runs its layers from Python. On the H200 (Llama-3.1-8B, Poisson 16 req/s of
#: 1024 in / 256 out, one call): median TPOT 9.56 ms at 512 against 12.46 ms at 8192 (vLLM V1's
#: serving default) and 21.47 ms at 1024, whose steps fall outside the graphs
#: (docs/benchmarks.md, the twenty-eighth session). Prompt-heavy servers trade TTFT for it:
#: ``--max-num-batched-tokens 8192`` restores the large steps.
GPU_SERVING_MAX_NUM_BATCHED_TOKENS = 512


def max_num_batched_tokens_for_memory(total_bytes: int, serving: bool) -> int:
    """The default ``max_num_batched_tokens`` for a GPU of ``total_bytes``, for a server
    (``serving``) or an offline run."""
    if serving:
        return GPU_SERVING_MAX_NUM_BATCHED_TOKENS
    if total_bytes < LARGE_DEVICE_BYTES:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return LARGE_DEVICE_OFFLINE_MAX_NUM_BATCHED_TOKENS


class Platform:
    """A kind of device kvik can run on, provided by a platform plugin.

    Subclasses set the class attributes and override what differs. ``is_present()`` must stay cheap:
    it is called for every installed platform by ``kvik env`` and by automatic selection, so it may
    import no kernels and must create no device context (the engine process is started later).
    Kernels are registered in ``on_selected()``, never on import.
    """

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"  # torch device type
    dist_backend: ClassVar[str] = "gloo"
    #: Higher wins automatic selection. CPU is 0; accelerators use 100; vendors choose their own.
    priority: ClassVar[int] = 0
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: Quantization methods (registered names) this platform runs; a method may also name the
    #: platforms it runs on itself (``QuantizationConfig.platforms``).
    supported_quantization: ClassVar[tuple[str, ...]] = ()
    #: Attention backend names in order of preference.
    attention_backends: ClassVar[tuple[str, ...]] = ()
    #: The graph runner this platform offers: "cuda_graphs" or "none".
    graph_support: ClassVar[str] = "none"
    #: How layers call the small ops (norms, rotary, activation), unless the engine's
    #: ``ops_dispatch`` option says otherwise: "torch_ops" through ``torch.ops.kvik``, reaching
    #: the kernels this platform registers; "direct" for a platform whose kernels would be
    #: kvik.ops' references anyway, which then run as plain calls (no dispatch cost, fusable by
    #: torch.compile). See kvik.ops.
    ops_dispatch: ClassVar[OpsDispatch] = "torch_ops"

    @classmethod
    def is_present(cls) -> bool:
        raise NotImplementedError

    @classmethod
    def details(cls) -> dict[str, Any]:
        """What ``kvik env`` shows, present or not: cheap, and no device context."""
        return {}

    @classmethod
    def device_capability(cls) -> tuple[int, int] | None:
        return None

    @classmethod
    def total_memory_bytes(cls) -> int:
        raise NotImplementedError

    @classmethod
    def free_memory_bytes(cls) -> int:
        raise NotImplementedError

    @classmethod
    def device(cls, index: int) -> torch.device:
        """The torch device of local rank ``index`` (each rank's worker asks for its own)."""
        import torch

        return (
            torch.device(cls.device_type, index)
            if cls.device_type != "cpu"
            else torch.device("cpu")
        )

    @classmethod
    def default_dtype(cls) -> str:
        """The dtype ``dtype="auto"`` means on this platform."""
        return cls.supported_dtypes[0]

    @classmethod
    def default_max_num_seqs(cls) -> int:
        """``max_num_seqs`` when the user gives none. A platform whose devices can be large
        answers ``max_num_seqs_for_memory`` of their memory, asked without making a device
        context in the caller's process (the front end's)."""
        return DEFAULT_MAX_NUM_SEQS

    @classmethod
    def default_max_num_batched_tokens(cls, serving: bool) -> int:
        """``max_num_batched_tokens`` when the user gives none, for a server (``serving``) or an
        offline run; a platform whose devices can be large answers
        ``max_num_batched_tokens_for_memory``, as for ``default_max_num_seqs``."""
        return DEFAULT_MAX_NUM_BATCHED_TOKENS

    @classmethod
    def on_selected(cls) -> None:
        """Called once when this platform is chosen: register kernels for its device here."""

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Adjust defaults and reject what this platform cannot run (raise ValueError)."""

    @classmethod
    def default_kv_cache_bytes(cls, config: EngineConfig) -> int:
        """How much memory the KV cache gets when the user gives no size."""
        return int(cls.free_memory_bytes() * MEMORY_UTILIZATION)

    @classmethod
    def zeroed_kv_cache(
        cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A layer's KV cache, all zeros: masked-out slots still meet a zero attention weight, and
        0 * NaN from uninitialised memory would poison the sum. A platform whose memory the OS
        zeroes on first touch answers that (``kvik_cpu``), rather than writing every byte now."""
        import torch

        return torch.zeros(shape, dtype=dtype, device=device)

    #: Whether a worker sizes the KV cache by profiling a step on the device (accelerators, which
    #: then answer the memory questions below) rather than from ``default_kv_cache_bytes``.
    profiles_memory: ClassVar[bool] = False

    @classmethod
    def device_memory_info(cls, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes of ``device`` as the driver counts them."""
        return cls.free_memory_bytes(), cls.total_memory_bytes()

    @classmethod
    def reset_peak_memory(cls, device: torch.device) -> None:
        """Forget the allocator's peak on ``device`` (before a profiling step)."""
        raise NotImplementedError(f"platform {cls.name} does not profile memory")

    @classmethod
    def peak_memory_bytes(cls, device: torch.device) -> int:
        """The allocator's peak allocation on ``device`` since ``reset_peak_memory``."""
        raise NotImplementedError(f"platform {cls.name} does not profile memory")

    @classmethod
    def reserved_memory_bytes(cls, device: torch.device) -> int:
        """What the allocator holds from the driver on ``device`` (cached blocks included)."""
        raise NotImplementedError(f"platform {cls.name} does not profile memory")

    @classmethod
    def empty_cache(cls, device: torch.device) -> None:
        """Give the allocator's cached blocks back to the driver."""

    @classmethod
    def linear_kernel(cls, scheme: str, layer: nn.Module) -> LinearKernel:
        """The kernel that computes ``layer``'s product in ``scheme`` ("unquantized",
        "fp8_block", "fp8_scaled": kvik.quantization.kernels) on this platform, asked once per
        layer after loading. By default core's PyTorch kernel; a platform returns its own where it
        has a faster one (for the layer's shape, if it likes)."""
        from kvik.quantization.kernels import reference_kernel

        return reference_kernel(scheme)

    @classmethod
    def fuses_activation_quantization(cls, kind: str) -> bool:
        """Whether norms and activations on this platform write the quantized input (``kind``:
        kvik.quantization.activation) of the linear layer they feed, instead of the layer
        quantizing it (one launch fewer a layer on a GPU). Off by default: the producers' ops
        (``torch.ops.kvik.*_fp8_group_quant``) then need this platform's kernels."""
        return False

    @classmethod
    def prepare_model(cls, model: nn.Module, config: EngineConfig) -> None:
        """After loading, once the layers' quantization methods have processed their weights
        (``linear_kernel``): anything else this platform does to a loaded model."""

    @classmethod
    def step_runner_class(cls, config: EngineConfig) -> type[StepRunner]:
        """How the runner executes a prepared step on this platform: eager by default; a platform
        with CUDA graphs or a native decode loop returns its own (kvik.worker.step_runner)."""
        from kvik.worker.step_runner import StepRunner

        return StepRunner

    @classmethod
    def step_graphs(cls) -> StepGraphs | None:
        """A fresh ``StepGraphs`` where the platform can replay graphs (None: it cannot)."""
        return None

    @classmethod
    def async_scheduling_default(cls) -> bool:
        """Whether the engine overlaps scheduling with the device's step unless told otherwise:
        worth it where the device runs asynchronously to the host."""
        return cls.device_type != "cpu"

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    @classmethod
    def synchronize(cls) -> None:
        """Wait for queued device work (a no-op where work is synchronous)."""
