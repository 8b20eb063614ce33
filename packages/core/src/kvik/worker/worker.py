"""A rank's worker: its device, its place in the world, its KV cache's size and its model runner.

Every executor builds one ``Worker`` per rank, in the engine core's process (``UniProcExecutor``)
or in a process of the rank's own (``MultiprocExecutor``). The worker asks the platform questions
(which device, which collective backend, how much memory) and does the work itself: joining the
world, building the runner, profiling a step to size the KV cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvik.distributed.parallel_state import (
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from kvik.worker.memory_profiling import kv_cache_budget_bytes

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.scheduler.output import SchedulerOutput
    from kvik.worker.model_runner import ModelRunner
    from kvik.worker.step_io import ModelRunnerOutput, PendingStep

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        platform: type[Platform],
        *,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
        runner: Any = None,
    ) -> None:
        """``runner``: a model runner built elsewhere (tests drive the engine over a fake one);
        by default the worker builds a ``ModelRunner`` on its device."""
        self.config = config
        self.platform = platform
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = config.parallel.world_size
        self.device = platform.device(local_rank)
        if runner is None and self.device.type != "cpu":
            # Allocations without an explicit device, and the collective library's
            # communicators, go to this rank's device.
            torch.accelerator.set_device_index(self.device.index)
        self._join_world(distributed_init_method)
        platform.on_selected()
        platform.seed_everything(config.model.seed)
        if runner is None:
            from kvik.worker.model_runner import ModelRunner

            runner = ModelRunner(config, platform, self.device)
        self.model_runner: ModelRunner = runner

    def _join_world(self, distributed_init_method: str | None) -> None:
        if self.world_size == 1 and torch.distributed.is_initialized():
            # The process joined a world and built its groups before the engine (a harness that
            # launches the ranks itself, as an external launcher will): they stand.
            return
        if self.world_size > 1:
            if distributed_init_method is None:
                raise ValueError(
                    f"rank {self.rank} of {self.world_size} needs a distributed_init_method"
                )
            init_distributed_environment(
                self.world_size, self.rank, distributed_init_method, self.platform.dist_backend
            )
        initialize_model_parallel(self.config.parallel.tensor_parallel_size)

    def num_kv_blocks(self) -> int:
        """How many KV cache blocks this rank's memory holds (the executor takes the least)."""
        cache = self.config.cache
        per_block = self.model_runner.kv_cache_bytes_per_block()
        if cache.num_blocks is not None or cache.kv_cache_memory_bytes:
            self._check_given_cache_fits(cache.num_blocks, per_block)
        if cache.num_blocks is not None:
            return cache.num_blocks
        budget = kv_cache_budget_bytes(self.config, self.platform, self.model_runner)
        return budget // per_block

    def _check_given_cache_fits(self, num_blocks: int | None, per_block: int) -> None:
        """A KV cache the user sized (num_kv_blocks, kv_cache_memory_bytes) must fit in the
        device's free memory: a clear error here, not the allocator's failure (or the kernel's
        out-of-memory kill) when it is made."""
        cache = self.config.cache
        need = num_blocks * per_block if num_blocks is not None else cache.kv_cache_memory_bytes
        try:
            free, _ = self.platform.device_memory_info(self.device)
        except NotImplementedError:  # a platform that cannot tell: its allocator will
            return
        if need > free:
            gib = 1024**3
            given = (
                f"num_kv_blocks={num_blocks} ({per_block} bytes a block)"
                if num_blocks is not None
                else f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}"
            )
            raise ValueError(
                f"the KV cache asked for, {given}, needs {need / gib:.1f} GiB, more than the "
                f"{free / gib:.1f} GiB free on {self.device}: give it less"
            )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def describe(self) -> dict[str, Any]:
        """What the engine reports about this rank once it is ready."""
        return {
            "rank": self.rank,
            "device": _device_name(self.device),
            "attention_backend": self.model_runner.backend.name,
        }

    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        return self.model_runner.launch(scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Release the KV cache and leave the world (a single-rank worker never joined one)."""
        self.model_runner.release_kv_cache()
        if self.world_size > 1:
            destroy_model_parallel()


def _device_name(device: torch.device) -> str:
    """The chip as torch names it ("NVIDIA H200"), or the CPU's model name; asked here, where
    the device is in use (the front end and the engine core never touch it)."""
    from kvik.bench.common import cpu_model

    try:
        if device.type == "cpu":
            return cpu_model()
        module = getattr(torch, device.type, None)
        if module is None or not hasattr(module, "get_device_name"):
            return device.type
        return module.get_device_name(device)
    except Exception as e:  # a device torch cannot name: say so rather than fail the start
        return f"unknown ({type(e).__name__})"
