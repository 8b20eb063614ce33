"""A platform's attention chooser and decode planner see the KV cache's dtype and, where they take
a ``query_dtype`` keyword, the queries' dtype (None given: the cache's); those written without the
keyword register and run as before."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvik.triton_kernels import attention  # noqa: E402
from kvik.triton_kernels.paged_attention import AttentionConfig  # noqa: E402


@pytest.fixture
def test_arch():
    """An architecture prefix of the test's own, removed afterwards."""
    yield "testarch"
    attention._CHOOSERS.pop("testarch", None)
    attention.register_decode_plans("testarch", None)
    attention.attention_config.cache_clear()


def test_a_chooser_with_query_dtype_receives_it(test_arch):
    seen = []

    def chooser(arch, head_size, group, max_query_len, dtype, query_dtype=None):
        seen.append((dtype, query_dtype))
        return AttentionConfig(16, 32 if query_dtype == torch.float32 else 64, 4, 2)

    attention.register_attention_configs(test_arch, chooser)
    e4m3 = torch.float8_e4m3fn
    assert attention.attention_config("testarch1", 128, 4, 1, e4m3, torch.float32).tile_n == 32
    assert attention.attention_config("testarch1", 128, 4, 1, e4m3).tile_n == 64
    assert seen == [(e4m3, torch.float32), (e4m3, e4m3)]


def test_a_chooser_and_planner_without_it_run_as_before(test_arch):
    def chooser(arch, head_size, group, max_query_len, dtype):
        return AttentionConfig(16, 16, 1, 1)

    def planner(arch, head_size, group, dtype, programs, num_sms):
        return (AttentionConfig(16, 32, 2, 2), 3) if programs > 8 else None

    attention.register_attention_configs(test_arch, chooser)
    attention.register_decode_plans(test_arch, planner)
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    config = attention.attention_config("testarch1", 128, 4, 1, e4m3, f32)
    assert config == AttentionConfig(16, 16, 1, 1)
    launch = attention.decode_launch("testarch1", 128, 4, e4m3, 4, 8, 4096, 100, f32)
    assert launch == (AttentionConfig(16, 32, 2, 2), 3)
    launch = attention.decode_launch("testarch1", 128, 4, e4m3, 1, 8, 4096, 100, f32)
    assert launch[0] == AttentionConfig(16, 16, 1, 1)


def test_a_chooser_taking_any_keyword_gets_query_dtype(test_arch):
    def chooser(*args, **options):
        assert options == {"query_dtype": torch.bfloat16}
        return AttentionConfig(16, 16, 1, 1)

    attention.register_attention_configs(test_arch, chooser)
    assert attention.attention_config("testarch1", 64, 1, 1, torch.bfloat16).tile_n == 16
