"""EngineCore: the scheduler, the KV cache manager and the model runner, driven one step at a time."""

from __future__ import annotations

import logging

from kvik.config import EngineConfig
from kvik.kv_cache.manager import KVCacheManager
from kvik.platforms.selection import select_platform
from kvik.request import Request
from kvik.scheduler.output import EngineCoreOutput
from kvik.scheduler.scheduler import Scheduler
from kvik.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = select_platform(config.device)
        self.platform.on_selected()
        self.platform.check_and_update_config(config)
        self.platform.seed_everything(config.model.seed)
        self.runner = ModelRunner(config, self.platform)
        self.num_kv_blocks = self._num_kv_blocks()
        self.runner.initialize_kv_cache(self.num_kv_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        logger.info(
            "engine ready on %s: %d KV blocks of %d tokens, attention %s",
            self.platform.name,
            self.num_kv_blocks,
            config.cache.block_size,
            self.runner.backend.name,
        )

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
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update: one forward pass over everything scheduled."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(
            scheduler_output, runner_output.sampled_token_ids
        )
        for out in outputs:
            out.new_logprobs = runner_output.logprobs.get(out.request_id)
            out.prompt_logprobs = runner_output.prompt_logprobs.get(out.request_id)
        return outputs
