"""Executors on the CPU (gloo, two rank processes): the ``mp`` executor against ``uni``, the KV
cache's size over ranks, and a rank killed in the middle of a request.

Two ranks shard the model (tensor parallelism over gloo); their tokens must be the ones one rank
samples, which tests the executor (the schedule each rank rebuilds, the tokens rank 0 sends back,
asynchronous steps) on top of the layers. Each test starts as few engines as it can: CI is small.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
from process_checks import alive

from kvik import LLM, SamplingParams
from kvik.distributed.parallel_state import get_tp_group
from kvik.engine.args import EngineArgs
from kvik.engine.async_llm import AsyncLLM
from kvik.engine.core import EngineCore
from kvik.engine.core_client import EngineDeadError
from kvik_cpu.platform import CpuPlatform

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 13, 2, 7]}, {"prompt_token_ids": [3, 4]}]
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128, max_num_seqs=4)


def _greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _start_mp(folder: str, async_scheduling: bool, max_tokens: int):
    one = LLM(folder, async_scheduling=async_scheduling, **ENGINE)
    expected = _greedy(one, max_tokens)
    one.shutdown()
    two = LLM(folder, async_scheduling=async_scheduling, tensor_parallel_size=2, **ENGINE)
    executor = two.engine.executor
    assert executor.name == "mp" and executor.world_size == 2
    pids = executor.rank_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert _greedy(two, max_tokens) == expected
    return two, expected


def test_a_deleted_llm_frees_its_kv_cache_at_once(tiny_model):
    """The runner's objects hold reference cycles, so what they own waits for the cyclic
    collector; the KV cache (4.4 GB by default on the CPU) must not: the LLM's finalizer shuts
    the engine down, which drops it. Checked with the collector off."""
    import gc
    import weakref

    llm = LLM(str(tiny_model("llama")), **ENGINE)
    _greedy(llm, 2)
    layers = llm.engine.executor.model_runner.attention_layers.values()
    caches = [weakref.ref(layer.kv_cache) for layer in layers]
    assert caches and all(cache() is not None for cache in caches)
    gc.disable()
    try:
        del llm, layers
        assert all(cache() is None for cache in caches)
    finally:
        gc.enable()


def test_mp_executor_gives_the_tokens_of_one_rank_and_shuts_down(tiny_model):
    two, expected = _start_mp(str(tiny_model("llama")), async_scheduling=True, max_tokens=6)
    # A second batch: the ranks' mirrors of finished requests were dropped, new ones sent.
    assert _greedy(two, 3) == [tokens[:3] for tokens in expected]
    pids = two.engine.executor.rank_pids
    two.shutdown()
    assert not any(alive(pid) for pid in pids)


def test_killed_rank_fails_the_offline_llm(tiny_model):
    from kvik.executor import RankFailedError

    llm, _ = _start_mp(str(tiny_model("qwen3")), async_scheduling=False, max_tokens=4)
    engine, ranks = llm.engine, llm.engine.executor.rank_pids
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    _, token_ids, params = llm.input_processor.process(PROMPTS[0], params)
    engine.add_request(
        llm.input_processor.make_request("r0", token_ids, params, 0, time.monotonic())
    )
    for _ in range(3):
        engine.step()
    os.kill(ranks[0], signal.SIGKILL)
    killed_at = time.monotonic()
    # With the model really split, rank 1 may report first: its all-reduce with the dead rank
    # fails. Either way the engine fails the request with the rank's error, in time.
    with pytest.raises(RankFailedError, match=r"kvik-rank-0|rank 1 failed"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - killed_at < 30
    assert not any(alive(pid) for pid in ranks)


class RankSkewedCpuPlatform(CpuPlatform):
    """The CPU, where rank r has a KV cache budget of 2^-r of rank 0's."""

    name = "cpu-rank-skewed"
    budget_bytes = 1 << 20

    @classmethod
    def default_kv_cache_bytes(cls, config) -> int:
        return cls.budget_bytes >> get_tp_group().rank_in_group


def test_kv_cache_blocks_are_the_least_over_ranks(tiny_model):
    folder = tiny_model("llama")
    hf = json.loads((folder / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    block_size = 16
    # K and V, fp32, every layer, each rank's share of the KV heads (one, replicated, at least).
    kv_heads = max(1, hf["num_key_value_heads"] // 2)
    per_block = 2 * block_size * kv_heads * head_dim * 4 * hf["num_hidden_layers"]
    budget = RankSkewedCpuPlatform.budget_bytes
    assert (budget // 2) // per_block < budget // per_block  # the ranks disagree
    args = dict(ENGINE, num_kv_blocks=None, max_model_len=32, block_size=block_size)
    config = EngineArgs(model=str(folder), tensor_parallel_size=2, **args).create_engine_config()
    assert config.parallel.world_size == 2 and config.parallel.executor_backend == "mp"
    engine = EngineCore(config, platform=RankSkewedCpuPlatform)
    try:
        assert engine.num_kv_blocks == (budget // 2) // per_block
        assert engine.kv_cache_manager.num_blocks == engine.num_kv_blocks
    finally:
        engine.shutdown()


def test_killed_rank_fails_requests_and_shuts_down(tiny_model):
    """Through the server's path: front end, engine core process, two rank processes."""

    async def scenario() -> None:
        args = EngineArgs(model=str(tiny_model("llama")), tensor_parallel_size=2, **ENGINE)
        llm = await AsyncLLM.create(args)
        info = llm.client.ready_info
        core, ranks = llm.client.process, info["rank_pids"]
        assert len(set(ranks)) == 2 and core.pid not in ranks
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        seen = 0
        killed_at = None
        with pytest.raises(EngineDeadError, match="rank"):
            async for output in llm.generate(PROMPTS[0], params, "r0"):
                seen = len(output.outputs[0].token_ids)
                if seen >= 3 and killed_at is None:
                    os.kill(ranks[1], signal.SIGKILL)
                    killed_at = time.monotonic()
        assert killed_at is not None and 3 <= seen < 100
        # The engine core exits by itself, and takes rank 0 with it.
        while core.is_alive() or any(alive(pid) for pid in ranks):
            assert time.monotonic() - killed_at < 30, "the engine did not shut down in 30 s"
            await asyncio.sleep(0.1)
        assert not llm.is_healthy
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(PROMPTS[1], params, "r1"):
                pass
        await llm.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 240))
