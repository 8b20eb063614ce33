"""The executor seam: how the engine core reaches its ranks' workers.

``EngineCore`` talks to an ``Executor`` only: it asks for the KV cache's size (the least any rank
can hold), has every rank allocate it, and launches each step's schedule on every rank, taking the
sampled tokens from rank 0 (every rank samples the same tokens: their logits are the same). An
executor may run its ranks in the engine core's process (``uni``), one process each on this host
(``mp``), or elsewhere (Ray, an external launcher: later kinds register their class by name in
``kvik.executor``).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.scheduler.output import SchedulerOutput
    from kvik.worker.step_io import ModelRunnerOutput


class PendingOutput(Protocol):
    """A launched step; ``collect()`` waits for rank 0's sampled tokens."""

    def collect(self) -> ModelRunnerOutput: ...


class RankFailedError(RuntimeError):
    """A rank died, reported an error or did not answer in time: the engine cannot go on."""


class Executor(ABC):
    #: The name ``--distributed-executor-backend`` gives this kind.
    name: ClassVar[str]

    def __init__(self, config: EngineConfig, platform: type[Platform]) -> None:
        self.config = config
        self.platform = platform
        self.world_size = config.parallel.world_size

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every rank; their results in rank order."""

    @abstractmethod
    def launch(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start a step on every rank; the result gives rank 0's output when collected."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).collect()

    def determine_num_kv_blocks(self) -> int:
        """The KV cache's block count: the least over ranks, as every rank holds every block
        (of its share of the heads)."""
        return min(self.collective_rpc("num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def describe(self) -> dict[str, Any]:
        """Rank 0's device and attention backend."""
        return self.collective_rpc("describe")[0]

    @property
    def rank_pids(self) -> list[int]:
        """The process of each rank, in rank order."""
        return [os.getpid()] * self.world_size

    def check_health(self) -> None:
        """Raise ``RankFailedError`` when a rank is gone (an in-process rank cannot be)."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank and release what the executor holds; safe to call twice."""
