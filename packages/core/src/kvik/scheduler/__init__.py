"""The scheduler decides what runs each step; the KV cache manager only keeps the accounts."""

from kvik.scheduler.output import (
    EngineCoreOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from kvik.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = [
    "EngineCoreOutput",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
