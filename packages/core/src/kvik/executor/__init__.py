"""Executors by name (``--distributed-executor-backend``): where the engine core's ranks run.

Core registers ``uni`` (one rank in the engine core's process) and ``mp`` (one process per rank
on this host). A later kind (Ray, an external launcher) registers its class here under its name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvik.executor.base import Executor, RankFailedError
from kvik.plugins.registry import Registry

if TYPE_CHECKING:
    from kvik.config import EngineConfig

__all__ = ["Executor", "RankFailedError", "executor_class", "register_executor"]

_EXECUTORS = Registry("distributed executor backend")
_EXECUTORS.register_from("kvik")("uni", "kvik.executor.uniproc:UniProcExecutor")
_EXECUTORS.register_from("kvik")("mp", "kvik.executor.multiproc:MultiprocExecutor")


def register_executor(name: str, target: str | object, plugin: str) -> None:
    """Add an executor kind: ``target`` is ``"package.module:Class"`` or a factory of it."""
    _EXECUTORS.register_from(plugin)(name, target)


def executor_class(config: EngineConfig) -> type[Executor]:
    return _EXECUTORS.resolve(config.parallel.executor_backend)
