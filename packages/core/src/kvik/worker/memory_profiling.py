"""How many bytes a rank's KV cache gets: the user's figure, the platform's default, or what a
profiling step on the rank's own device leaves of ``gpu_memory_utilization``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
GiB = 1024**3


def kv_cache_budget_bytes(
    config: EngineConfig, platform: type[Platform], runner: ModelRunner
) -> int:
    """The KV cache's bytes on this rank, asked once its model is loaded."""
    if config.cache.kv_cache_memory_bytes:
        return config.cache.kv_cache_memory_bytes
    if not platform.profiles_memory:
        return platform.default_kv_cache_bytes(config)
    return profiled_kv_cache_bytes(config, platform, runner)


def profiled_kv_cache_bytes(
    config: EngineConfig, platform: type[Platform], runner: ModelRunner
) -> int:
    """What a profiling step leaves of ``gpu_memory_utilization`` of the device's memory.

    One step of ``max_num_batched_tokens`` dummy tokens (sampling ``max_num_seqs`` rows) measures
    the allocator's peak; memory outside the allocator (the driver's context, other processes, the
    communicators of a multi-rank world) is counted from the driver's free memory; the step
    runner's graphs (a trial capture) are kept free too.
    """
    device = runner.device
    platform.synchronize()
    platform.empty_cache(device)
    platform.reset_peak_memory(device)
    runner.profile_run(
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs,
        config.model.max_model_len,
    )
    platform.synchronize()
    peak = platform.peak_memory_bytes(device)
    platform.empty_cache(device)
    free, total = platform.device_memory_info(device)
    outside = max(0, total - free - platform.reserved_memory_bytes(device))
    graphs = runner.step_runner.reserved_memory_bytes()
    utilization = config.cache.gpu_memory_utilization
    limit = total * utilization
    budget = int(limit - peak - outside - graphs)
    logger.info(
        "memory profile of %s: %.2f GiB of %.2f GiB allowed (gpu_memory_utilization=%.2f); peak "
        "%.2f GiB in the allocator, %.2f GiB outside it, %.2f GiB for graphs; KV cache %.2f GiB",
        device, limit / GiB, total / GiB, utilization, peak / GiB, outside / GiB, graphs / GiB,
        budget / GiB,
    )  # fmt: skip
    if budget <= 0:
        raise ValueError(
            f"no memory is left for the KV cache on {device}: gpu_memory_utilization="
            f"{utilization} allows {limit / GiB:.2f} GiB of the device's {total / GiB:.2f} GiB, "
            f"and the model's profiling step peaked at {peak / GiB:.2f} GiB with "
            f"{outside / GiB:.2f} GiB used outside the allocator; raise gpu_memory_utilization "
            "or lower max_num_batched_tokens / max_num_seqs"
        )
    return budget
