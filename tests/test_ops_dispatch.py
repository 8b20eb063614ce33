"""How layers call the small ops is each engine's own choice (``ops_dispatch``): two engines in one
process, one calling kvik.ops' references directly and one going through ``torch.ops.kvik``,
each call their own implementation, and neither changes what a later build gets."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import ragged_prompts

from kvik import LLM, SamplingParams, ops
from kvik.layers.activation import SiluAndMul
from kvik.layers.norm import RMSNorm
from kvik.layers.rotary import RotaryEmbedding

SMALL_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def reference_calls(monkeypatch) -> Counter:
    """Counts calls of each reference that a layer built from now on calls directly."""
    calls: Counter = Counter()

    def counting(name, reference):
        def call(*args, **kwargs):
            calls[name] += 1
            return reference(*args, **kwargs)

        return call

    for name in SMALL_OPS:
        monkeypatch.setitem(ops._REFERENCES, name, counting(name, ops._REFERENCES[name]))
    return calls


def small_ops_of(llm: LLM) -> dict[str, set]:
    """What the engine's layers call for each small op."""
    called: dict[str, set] = {name: set() for name in SMALL_OPS}
    for module in llm.engine.runner.model.modules():
        if isinstance(module, RMSNorm):
            called["rms_norm"].add(module._rms_norm)
            called["fused_add_rms_norm"].add(module._fused_add_rms_norm)
        elif isinstance(module, RotaryEmbedding):
            called["rotary_embedding"].add(module._rotary_embedding)
        elif isinstance(module, SiluAndMul):
            called["silu_and_mul"].add(module._silu_and_mul)
    return called


def test_two_engines_in_one_process_each_call_their_own_small_ops(tiny_model, reference_calls):
    folder = str(tiny_model("llama"))
    direct = LLM(folder, dtype="float32", num_kv_blocks=64, ops_dispatch="direct")
    through_torch_ops = LLM(folder, dtype="float32", num_kv_blocks=64, ops_dispatch="torch_ops")
    assert direct.config.ops_dispatch == "direct"
    assert through_torch_ops.config.ops_dispatch == "torch_ops"
    # Each engine's layers hold its own choice, although the second was built after the first.
    for name, called in small_ops_of(direct).items():
        assert called == {ops._REFERENCES[name]}, name
    for name, called in small_ops_of(through_torch_ops).items():
        assert called == {getattr(torch.ops.kvik, name)}, name

    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(2, seed=4)]
    reference_calls.clear()  # the direct engine's start-up warm-up steps called them
    through_torch_ops.generate(prompts, GREEDY, use_tqdm=False)
    assert not reference_calls  # its layers never called a reference directly
    direct.generate(prompts, GREEDY, use_tqdm=False)
    assert set(reference_calls) == set(SMALL_OPS)


def test_the_platform_decides_when_the_engine_does_not(tiny_model):
    llm = LLM(str(tiny_model("llama")), dtype="float32", num_kv_blocks=64)
    platform_choice = llm.engine.platform.ops_dispatch
    assert llm.config.ops_dispatch == platform_choice
    expected = ops._REFERENCES if platform_choice == "direct" else None
    for name, called in small_ops_of(llm).items():
        want = expected[name] if expected else getattr(torch.ops.kvik, name)
        assert called == {want}, name


def test_layers_built_outside_an_engine_go_through_torch_ops():
    with ops.ops_dispatch("direct"):
        inside = RMSNorm(8)
        with ops.ops_dispatch("torch_ops"):
            nested = SiluAndMul()
        after_nested = SiluAndMul()
    outside = RMSNorm(8)
    assert inside._rms_norm is ops._REFERENCES["rms_norm"]
    assert nested._silu_and_mul is torch.ops.kvik.silu_and_mul
    assert after_nested._silu_and_mul is ops._REFERENCES["silu_and_mul"]
    assert outside._rms_norm is torch.ops.kvik.rms_norm
    with pytest.raises(ValueError, match="ops_dispatch must be one of"):
        with ops.ops_dispatch("native"):
            pass
