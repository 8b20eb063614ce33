"""The model compiled with torch.compile and split at attention (kvik.compilation.piecewise), on the
CPU: the same greedy tokens as the eager model over prefill, chunked-prefill, mixed and decode steps,
one trace for every token count, and one piece per stretch between attention calls. (The PIECEWISE
CUDA graphs over these pieces run on the H200: packages/platform-cuda/tests/test_gpu_graphs.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import ragged_prompts

from kvik import LLM, SamplingParams


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_models():
    # Dynamo's caches hold every compiled model (and its engine's KV cache) until reset.
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # One for the module: the first engine points inductor's caches there for the process.
    return tmp_path_factory.mktemp("compile-cache")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compiled_model_gives_the_eager_tokens(kind, tiny_model, cache_dir):
    folder = tiny_model(kind)
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(5, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(
        dtype="float32", device="cpu", max_num_batched_tokens=48, max_num_seqs=4, num_kv_blocks=64
    )

    eager = LLM(str(folder), enforce_eager=True, **common)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager

    config = json.dumps({"mode": 3, "cache_dir": str(cache_dir)})
    llm = LLM(str(folder), compilation_config=config, **common)
    compiled = llm.engine.runner.step_runner.compiled
    assert compiled is not None
    backend = compiled.backend
    # Compiled at start-up, not by the first request: one piece before the first attention, one
    # between each two, one after the last.
    assert backend.num_graphs_traced == 1
    assert backend.num_pieces == llm.config.model.hf_config.num_hidden_layers + 1
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Prefills of many lengths, chunks and mixed steps all ran on the one dynamic-shape trace.
    assert backend.num_graphs_traced == 1
    assert llm.stats.num_steps > len(prompts)
    assert any(p.is_file() for p in cache_dir.rglob("*"))  # inductor's caches went there


def test_compiled_bf16_model_on_the_cpus_packed_kernels(tiny_model, cache_dir):
    """bf16 on a CPU with native bf16 runs kvik_cpu's packed-weight C++ products; dynamo traces
    them through their fake implementations (kvik_cpu.extension), which they lacked: the
    compiled default model failed at its first linear layer. Same greedy tokens as eager."""
    folder = tiny_model("llama")
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(5, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(
        dtype="bfloat16", device="cpu", max_num_batched_tokens=48, max_num_seqs=4, num_kv_blocks=64
    )
    eager = LLM(str(folder), enforce_eager=True, **common)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    config = json.dumps({"mode": 3, "cache_dir": str(cache_dir)})
    llm = LLM(str(folder), compilation_config=config, **common)
    assert llm.engine.runner.step_runner.compiled is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_split_at_attention_cuts_around_each_attention_call():
    import torch.fx as fx

    import kvik.ops  # noqa: F401
    from kvik.compilation.piecewise import split_at_attention

    def f(x, out):
        y = torch.relu(x) + 1
        torch.ops.kvik.unified_attention(y, y, y, out, "layer.0")
        z = out * 2
        torch.ops.kvik.unified_attention(z, z, z, out, "layer.1")
        return out - 1

    gm = fx.symbolic_trace(f)
    split, pieces = split_at_attention(gm)
    names = [name for name, _ in split.named_children()]
    assert names == ["submod_0", "submod_1", "submod_2", "submod_3", "submod_4"]
    assert pieces == ["submod_0", "submod_2", "submod_4"]
    attention = [getattr(split, n) for n in ("submod_1", "submod_3")]
    for module in attention:
        calls = [n for n in module.graph.nodes if n.op == "call_function"]
        assert [c.target for c in calls] == [torch.ops.kvik.unified_attention.default] or [
            c.target for c in calls
        ] == [torch.ops.kvik.unified_attention]


def test_compiled_fp8_model_calls_the_fp8_op_and_gives_the_eager_tokens(
    tiny_model, cache_dir, monkeypatch
):
    """Online FP8 (per-channel weights, dynamic per-token activations): compiled, its products are
    the opaque ``kvik::fp8_scaled_linear`` op (a platform's Triton launchers are never traced),
    and the tokens are the eager FP8 model's."""
    import kvik.compilation.piecewise as piecewise

    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(3, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(
        dtype="float32", device="cpu", quantization="fp8", max_num_seqs=4, num_kv_blocks=64
    )
    eager = LLM(folder, enforce_eager=True, **common)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager

    targets = set()
    split = piecewise.split_at_attention

    def recording_split(gm):
        targets.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return split(gm)

    monkeypatch.setattr(piecewise, "split_at_attention", recording_split)
    config = json.dumps({"mode": 3, "cache_dir": str(cache_dir)})
    llm = LLM(folder, compilation_config=config, **common)
    op = torch.ops.kvik.fp8_scaled_linear
    assert op in targets or op.default in targets
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.engine.runner.step_runner.compiled.backend.num_graphs_traced == 1


@pytest.mark.parametrize("head_norms", [False, True], ids=["rotary", "rotary+head-norms"])
def test_a_backend_that_fuses_rotary_gets_the_rotation_inside_the_attention_op(
    tiny_model, cache_dir, monkeypatch, head_norms
):
    """With ``AttentionImpl.fuses_rotary`` (the Triton backend's: rotation and cache write in one
    launch), compiled code calls ``kvik::unified_attention_with_rotary`` instead of rotating in
    the graph: still one split per attention, and the eager tokens. Here the CPU backend takes
    the base class's ``forward_with_rotary`` (rotate, then attend) through the new op. With
    ``fuses_head_norms`` too, Qwen3's q/k norms go into the op (no RMSNorm over heads left in the
    graph), eagerly and compiled, and the tokens stay the eager unfused model's."""
    import kvik.compilation.piecewise as piecewise
    from kvik.attention.backend import AttentionImpl

    folder = str(tiny_model("qwen3"))
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", max_num_batched_tokens=48, num_kv_blocks=64)
    eager = LLM(folder, enforce_eager=True, **common)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager

    targets = []
    split = piecewise.split_at_attention

    def recording_split(gm):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return split(gm)

    monkeypatch.setattr(piecewise, "split_at_attention", recording_split)
    monkeypatch.setattr(AttentionImpl, "fuses_rotary", True)
    monkeypatch.setattr(AttentionImpl, "fuses_head_norms", head_norms)
    torch._dynamo.reset()  # a trace of this model class made without the fused op must not serve
    config = json.dumps({"mode": 3, "cache_dir": str(cache_dir)})
    llm = LLM(folder, compilation_config=config, **common)
    fused = torch.ops.kvik.unified_attention_with_rotary
    layers = llm.config.model.hf_config.num_hidden_layers
    assert sum(t in (fused, fused.default) for t in targets) == layers
    assert not any("rotary_embedding" in str(t) for t in targets)
    # RMSNorms in the graph: two a layer and the final one, plus q and k's where not fused.
    norms = sum("rms_norm" in str(t) for t in targets)
    assert norms == (2 * layers + 1 if head_norms else 4 * layers + 1)
    assert llm.engine.runner.step_runner.compiled.backend.num_pieces == layers + 1
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    if head_norms:
        del llm
        eager_fused = LLM(folder, enforce_eager=True, **common)
        outputs = eager_fused.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_compiled_engine_is_freed_when_dropped(tiny_model, cache_dir):
    """Dynamo's cache outlives the engine (it keeps the compiled pieces and their backend); it must
    not keep the engine, its model or its KV cache alive."""
    import gc
    import weakref

    config = json.dumps({"mode": 3, "cache_dir": str(cache_dir)})
    llm = LLM(
        str(tiny_model("llama")), dtype="float32", device="cpu", num_kv_blocks=64,
        compilation_config=config,
    )  # fmt: skip
    assert llm.engine.runner.step_runner.compiled.backend.num_graphs_traced == 1
    runner = weakref.ref(llm.engine.runner)
    kv_cache = weakref.ref(next(iter(llm.engine.runner.attention_layers.values())).kv_cache)
    del llm
    gc.collect()
    assert runner() is None and kv_cache() is None


def test_many_compiled_models_of_one_class_in_one_process():
    """Each compiled model keeps dynamo's entries on a code object of its own: the ninth model of
    one class (dynamo's recompile_limit is 8 per code object) compiles like the first."""
    from kvik.compilation.piecewise import CompiledModel

    class Tiny(torch.nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 8)
            torch.nn.init.normal_(self.embed.weight, generator=torch.Generator().manual_seed(seed))

        def forward(self, input_ids, positions):
            return self.embed(input_ids) * (positions[:, None] + 1)

    ids, pos = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])
    for seed in range(10):
        model = Tiny(seed)
        compiled = CompiledModel(model, use_inductor=False)
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
        assert compiled.backend.num_graphs_traced == 1
