"""EngineCore: the scheduler, the KV cache manager and the model runner, driven one step at a time.

Synchronous scheduling: each ``step()`` schedules, runs and collects one step.

Asynchronous scheduling (vLLM V1's; ``EngineConfig.async_scheduling``, decided in
``_resolve_async_scheduling``): the host schedules and launches step N+1 while the device still
runs step N, then collects N. One ``step()`` is::

    schedule N+1 -> launch N+1 -> collect N -> scheduler.update_from_output(N) -> outputs of N

so the host's scheduling and input preparation overlap the device's work. At most one step is in
flight when ``schedule()`` runs: the scheduler's placeholders (one per request that sampled in the
step in flight) stand for the tokens the device has not returned yet, and the runner reads them on
the device. When a request that may be scheduled next has a token in flight and a logits processor
that reads its output history (penalties, min tokens, bad words), the step in flight is collected
first, making that iteration synchronous (``Scheduler.must_collect_before_schedule``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvik.config import EngineConfig
from kvik.kv_cache.manager import KVCacheManager
from kvik.platforms.selection import select_platform
from kvik.request import Request
from kvik.scheduler.output import EngineCoreOutput, SchedulerOutput
from kvik.scheduler.scheduler import Scheduler
from kvik.spec_decode.config import refuse_unwired_speculation
from kvik.worker.nvtx import nvtx_range

if TYPE_CHECKING:
    from kvik.platforms.base import Platform
    from kvik.worker.model_runner import ModelRunnerOutput, PendingStep

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step that has not been collected."""

    scheduler_output: SchedulerOutput
    pending: PendingStep


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        platform: type[Platform] | None = None,
        runner: Any = None,
    ) -> None:
        """``platform`` and ``runner`` default to the selected platform and a ``ModelRunner``
        built on it; tests pass their own (a fake device)."""
        refuse_unwired_speculation(config.speculative)
        self.config = config
        self.platform = platform if platform is not None else select_platform(config.device)
        self.platform.on_selected()
        self.platform.check_and_update_config(config)
        self.platform.seed_everything(config.model.seed)
        if runner is None:
            from kvik.worker.model_runner import ModelRunner

            runner = ModelRunner(config, self.platform)
        self.runner = runner
        self.num_kv_blocks = self._num_kv_blocks()
        self.runner.initialize_kv_cache(self.num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.async_scheduling = self._resolve_async_scheduling()
        config.async_scheduling = self.async_scheduling
        config.scheduler.async_scheduling = self.async_scheduling
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self._in_flight: _InFlight | None = None
        logger.info(
            "engine ready on %s: %d KV blocks of %d tokens, attention %s, %s scheduling",
            self.platform.name,
            self.num_kv_blocks,
            config.cache.block_size,
            self.runner.backend.name,
            "asynchronous" if self.async_scheduling else "synchronous",
        )

    def _resolve_async_scheduling(self) -> bool:
        """The one place that decides whether steps overlap: the config's choice, or when it
        leaves it open (None), the platform's default (on for devices that run asynchronously to
        the host, i.e. not the CPU)."""
        wanted = self.config.async_scheduling
        if wanted is not None:
            return bool(wanted)
        default = getattr(self.platform, "async_scheduling_default", None)
        if default is not None:
            return bool(default())
        return self.platform.device_type != "cpu"

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        else:
            budget = cache.kv_cache_memory_bytes or self.platform.kv_cache_bytes(
                self.config, self.runner
            )
            num_blocks = budget // self.runner.kv_cache_bytes_per_block()
        # Every request must fit alone, or it could wait forever.
        needed = -(-self.config.model.max_model_len // cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens, fewer than the "
                f"{needed} one sequence of max_model_len={self.config.model.max_model_len} needs; "
                "give the cache more memory or lower max_model_len"
            )
        return num_blocks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort at once, also while a step holding the requests is in flight: that step's tokens
        for them are dropped when it is collected."""
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """True while any request is unfinished or a step is in flight (its outputs are due)."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Advance the engine by one step and return the outputs that came back.

        Synchronous: schedule, execute, update, over one forward pass. Asynchronous: schedule and
        launch the next step, then collect and return the one launched by the previous call (none
        on the first call); with nothing left to schedule, only collect.
        """
        if not self.async_scheduling:
            scheduler_output = self._schedule()
            runner_output = self.runner.execute_model(scheduler_output)
            return self._update(scheduler_output, runner_output)

        outputs: list[EngineCoreOutput] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self.scheduler.must_collect_before_schedule():
            # A request to schedule reads its output history and has a token in flight.
            outputs.extend(self._collect(previous))
            previous = None
        scheduler_output = self._schedule()
        # An empty step is still launched when it carries finished or preempted ids for the
        # runner (they are handed out once); otherwise there is nothing to launch.
        if (
            scheduler_output.scheduled
            or scheduler_output.finished_req_ids
            or scheduler_output.preempted_req_ids
        ):
            self._in_flight = _InFlight(scheduler_output, self.runner.launch(scheduler_output))
        if previous is not None:
            outputs.extend(self._collect(previous))
        return outputs

    def _schedule(self) -> SchedulerOutput:
        with nvtx_range("schedule", self.config.enable_nvtx):
            return self.scheduler.schedule()

    def _collect(self, in_flight: _InFlight) -> list[EngineCoreOutput]:
        return self._update(in_flight.scheduler_output, in_flight.pending.collect())

    def _update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        with nvtx_range("update", self.config.enable_nvtx):
            outputs = self.scheduler.update_from_output(
                scheduler_output, runner_output.sampled_token_ids
            )
        for out in outputs:
            out.new_logprobs = runner_output.logprobs.get(out.request_id)
            out.prompt_logprobs = runner_output.prompt_logprobs.get(out.request_id)
        return outputs
