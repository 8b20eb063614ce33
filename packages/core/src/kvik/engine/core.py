"""EngineCore: the scheduler, the KV cache manager and the executor of the model's ranks, driven
one step at a time. The executor (kvik.executor) runs each step on every rank's worker and hands
back rank 0's sampled tokens.

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

Speculative decoding (``EngineConfig.speculative``): the runner proposes each request's drafts
after its step and the scheduler schedules them in the next one; scheduling is then synchronous
(``_resolve_async_scheduling``), since the drafts depend on the tokens the step accepted.

Structured outputs: the ``StructuredOutputManager`` compiles each request's grammar on its own
threads; after scheduling, the core fills the step's token bitmasks (``grammar_bitmask`` of the
``SchedulerOutput``), which the runner applies to the logits. A request with a grammar reads its
output history, so under asynchronous scheduling its in-flight step is collected before it is
scheduled again, and its mask always follows every token sampled so far.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvik.config import EngineConfig
from kvik.executor import Executor, executor_class
from kvik.kv_cache.manager import KVCacheManager
from kvik.platforms.selection import select_platform
from kvik.request import Request
from kvik.scheduler.output import EngineCoreOutput, SchedulerOutput
from kvik.scheduler.scheduler import Scheduler
from kvik.spec_decode.config import check_speculative_engine, speculative_compilation
from kvik.structured_output import StructuredOutputManager
from kvik.worker.nvtx import nvtx_range

if TYPE_CHECKING:
    from kvik.executor.base import PendingOutput
    from kvik.platforms.base import Platform
    from kvik.structured_output.manager import GrammarBitmask
    from kvik.worker.model_runner import ModelRunner
    from kvik.worker.step_io import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step that has not been collected."""

    scheduler_output: SchedulerOutput
    pending: PendingOutput


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        platform: type[Platform] | None = None,
        runner: Any = None,
    ) -> None:
        """``platform`` defaults to the selected platform, the executor to the kind
        ``config.parallel`` names. ``runner``: a model runner for one in-process rank (tests pass
        a fake device)."""
        check_speculative_engine(config)
        speculative_compilation(config)
        self.config = config
        self.platform = platform if platform is not None else select_platform(config.device)
        # Checks the backend and reasoning parser; xgrammar loads at the first grammar.
        self.structured_outputs = StructuredOutputManager(config)
        self.platform.on_selected()
        self.platform.check_and_update_config(config)
        if runner is not None:
            from kvik.executor.uniproc import UniProcExecutor

            self.executor: Executor = UniProcExecutor(config, self.platform, runner=runner)
        else:
            self.executor = executor_class(config)(config, self.platform)
        try:
            self.num_kv_blocks = self._num_kv_blocks()
            self.executor.initialize_kv_cache(self.num_kv_blocks)
            self.rank0 = self.executor.describe()
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.async_scheduling = self._resolve_async_scheduling()
        config.async_scheduling = self.async_scheduling
        config.scheduler.async_scheduling = self.async_scheduling
        speculative = config.speculative
        if speculative is not None:
            config.scheduler.num_speculative_tokens = speculative.num_speculative_tokens
            if speculative.method in ("draft_model", "eagle3"):
                # The draft (or head) writes its proposals' keys past the scheduled tokens.
                config.scheduler.num_lookahead_tokens = speculative.num_speculative_tokens
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.structured_outputs)
        self._in_flight: _InFlight | None = None
        logger.info(
            "engine ready on %s (%d rank%s, %s executor): %d KV blocks of %d tokens, "
            "attention %s, %s scheduling",
            self.platform.name,
            self.executor.world_size,
            "s" if self.executor.world_size > 1 else "",
            self.executor.name,
            self.num_kv_blocks,
            config.cache.block_size,
            self.rank0["attention_backend"],
            "asynchronous" if self.async_scheduling else "synchronous",
        )

    def _resolve_async_scheduling(self) -> bool:
        """The one place that decides whether steps overlap: the config's choice, or when it
        leaves it open (None), the platform's default (on for devices that run asynchronously to
        the host, i.e. not the CPU)."""
        wanted = self.config.async_scheduling
        if self.config.speculative is not None:
            # Drafts are proposed from the tokens a step accepted, so a step cannot be scheduled
            # before the previous one is back: speculation runs synchronously.
            if wanted:
                raise ValueError(
                    "speculative decoding runs with synchronous scheduling only; leave "
                    "async_scheduling unset or false"
                )
            return False
        if wanted is not None:
            return bool(wanted)
        default = getattr(self.platform, "async_scheduling_default", None)
        if default is not None:
            return bool(default())
        return self.platform.device_type != "cpu"

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        num_blocks = self.executor.determine_num_kv_blocks()
        # Every request must fit alone, or it could wait forever.
        needed = -(-self.config.model.max_model_len // cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens, fewer than the "
                f"{needed} one sequence of max_model_len={self.config.model.max_model_len} needs; "
                "give the cache more memory or lower max_model_len"
            )
        return num_blocks

    @property
    def runner(self) -> ModelRunner:
        """The model runner of an in-process rank (``uni``): what tests and tools inspect."""
        runner = getattr(self.executor, "model_runner", None)
        if runner is None:
            raise AttributeError(
                f"the {self.executor.name!r} executor runs its model runners in other processes"
            )
        return runner

    def check_health(self) -> None:
        """Raise when a rank is gone (``kvik.executor.RankFailedError``)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's ranks; the engine cannot step afterwards. Safe to call twice."""
        self.executor.shutdown()

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
            # Requests scheduling finished (a grammar that failed or admits no token).
            outputs = self.scheduler.take_early_outputs()
            runner_output = self.executor.execute_model(scheduler_output)
            return outputs + self._update(scheduler_output, runner_output)

        outputs = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self.scheduler.must_collect_before_schedule():
            # A request to schedule reads its output history and has a token in flight.
            outputs.extend(self._collect(previous))
            previous = None
        scheduler_output = self._schedule()
        outputs.extend(self.scheduler.take_early_outputs())
        # An empty step is still launched when it carries finished or preempted ids for the
        # runner (they are handed out once); otherwise there is nothing to launch.
        if (
            scheduler_output.scheduled
            or scheduler_output.finished_req_ids
            or scheduler_output.preempted_req_ids
        ):
            self._in_flight = _InFlight(scheduler_output, self.executor.launch(scheduler_output))
        if previous is not None:
            outputs.extend(self._collect(previous))
        return outputs

    def _schedule(self) -> SchedulerOutput:
        with nvtx_range("schedule", self.config.enable_nvtx):
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.scheduled:
                grammar = self.structured_outputs.grammar_bitmask(scheduler_output.scheduled)
                scheduler_output.grammar_bitmask = grammar
                if grammar is not None:
                    self._finish_dead_ends(scheduler_output, grammar)
            elif self._in_flight is None:
                # Nothing to run but requests whose grammar is compiling: wait for one of them
                # rather than spin.
                waiting = self.scheduler.waiting_for_grammars()
                if waiting:
                    self.structured_outputs.wait_for_compiles(waiting, 0.01)
            return scheduler_output

    def _finish_dead_ends(self, scheduler_output: SchedulerOutput, grammar: GrammarBitmask) -> None:
        """Finish, before they sample, the step's requests whose constraint leaves no token to
        sample (``StructuredOutputManager.dead_ends``): with "error" and why, or with "stop"
        where their grammar allows only its end. They stay in the step (the runner has their
        state), and their tokens are dropped when it is collected."""
        for request, message, param in self.structured_outputs.dead_ends(
            scheduler_output.scheduled, grammar
        ):
            if message is None:
                self.scheduler.stop_request(request)
            else:
                logger.info("request %s failed: %s", request.request_id, message)
                self.scheduler.fail_request(request, message, param)

    def _collect(self, in_flight: _InFlight) -> list[EngineCoreOutput]:
        return self._update(in_flight.scheduler_output, in_flight.pending.collect())

    def _update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        with nvtx_range("update", self.config.enable_nvtx):
            outputs = self.scheduler.update_from_output(
                scheduler_output,
                runner_output.sampled_token_ids,
                getattr(runner_output, "spec_token_ids", None),
            )
        for out in outputs:
            out.new_logprobs = runner_output.logprobs.get(out.request_id)
            out.prompt_logprobs = runner_output.prompt_logprobs.get(out.request_id)
        return outputs
