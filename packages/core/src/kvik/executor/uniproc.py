"""One rank, in the engine core's own process: the schedule is handed over as it is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvik.executor.base import Executor
from kvik.worker.worker import Worker

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.scheduler.output import SchedulerOutput
    from kvik.worker.model_runner import ModelRunner
    from kvik.worker.step_io import ModelRunnerOutput, PendingStep


class UniProcExecutor(Executor):
    name = "uni"

    def __init__(
        self, config: EngineConfig, platform: type[Platform], *, runner: Any = None
    ) -> None:
        """``runner``: a model runner built elsewhere (tests pass a fake device)."""
        super().__init__(config, platform)
        if self.world_size != 1:
            raise ValueError(
                f"the uni executor runs one rank, not {self.world_size}; use "
                "--distributed-executor-backend mp"
            )
        self.worker = Worker(config, platform, runner=runner)

    @property
    def model_runner(self) -> ModelRunner:
        return self.worker.model_runner

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        # Through the runner's attribute each time, so that a test may wrap it.
        return self.worker.model_runner.launch(scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
