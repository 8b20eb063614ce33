"""The runner's persistent step buffers (kvik.worker.step_buffers) against the inputs built directly
from each step's requests, the way the runner built them before its buffers were persistent;
padding rows; and the rules that choose CUDA-graph sizes (which need no GPU to check)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ragged_prompts

from kvik import LLM, SamplingParams
from kvik.config import CompilationConfig, default_capture_sizes
from kvik.engine.args import EngineArgs
from kvik.worker.step_buffers import BlockTable


def direct_inputs(scheduler_output, block_size: int) -> dict[str, list[int]]:
    """A step's inputs from its requests, one token at a time: what the buffers must hold."""
    ids, positions, slots, starts, seq_lens, sample_rows = [], [], [], [0], [], []
    for s in scheduler_output.scheduled:
        request = s.request
        for p in range(s.start, s.start + s.num_tokens):
            ids.append(request.all_token_ids[p])
            positions.append(p)
            slots.append(s.block_ids[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + s.num_tokens)
        seq_lens.append(s.start + s.num_tokens)
        if s.samples:
            sample_rows.append(starts[-1] - 1)
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "query_start_loc": starts,
        "seq_lens": seq_lens,
        "logits_indices": sample_rows,
    }


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "copied"])
def test_buffers_hold_the_direct_inputs_of_every_step(tiny_model, separate):
    """Chunked prefill, decodes across block edges, requests finishing (rows shift) and
    preemption (a request readmitted with new blocks): every step's buffers equal the direct
    construction, and the block table's rows equal each request's blocks. ``copied`` keeps host
    and device buffers apart on the CPU, so the copies and the block table's scatter run."""
    llm = LLM(
        str(tiny_model("llama")),
        dtype="float32",
        enforce_eager=True,
        num_kv_blocks=12,
        max_model_len=96,
        max_num_batched_tokens=40,
    )
    engine, runner = llm.engine, llm.engine.runner
    runner._allocate_buffers(separate=separate)
    assert (runner.input_ids.device is runner.input_ids.host) is not separate
    prompts = ragged_prompts(8, seed=5, low=20, high=60)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
        engine.add_request(llm.input_processor.make_request(str(i), prompt, params, 0, 0.0))
    steps = 0
    while engine.has_unfinished_requests():
        so = engine.scheduler.schedule()
        if so.scheduled:
            inputs = runner.prepare_inputs(so)
            expected = direct_inputs(so, runner.block_size)
            r, t = len(so.scheduled), inputs.num_tokens
            assert inputs.num_padded == t  # the eager runner never pads
            got = {
                "input_ids": runner.input_ids.device[:t],
                "positions": runner.positions.device[:t],
                "slot_mapping": runner.slot_mapping.device[:t],
                "query_start_loc": runner.query_start_loc.device[: r + 1],
                "seq_lens": runner.seq_lens.device[:r],
                "logits_indices": inputs.logits_indices,
            }
            for name, values in expected.items():
                assert got[name].tolist() == values, (steps, name)
            for row, s in enumerate(so.scheduled):
                table = runner.block_table.device[row, : len(s.block_ids)].tolist()
                assert table == s.block_ids, (steps, row)
        output = runner.execute_model(so)
        engine.scheduler.update_from_output(so, output.sampled_token_ids)
        steps += 1
    stats = llm.stats
    assert stats.num_preemptions > 0 and stats.num_prefill_chunks > 0, stats


def test_block_table_sends_only_what_changed():
    table = BlockTable(4, 8, torch.device("cpu"), separate=True)
    sent: list[int] = []
    scatter = table._scatter

    def counting(index, value):
        sent.append(len(index))
        scatter(index, value)

    table._scatter = counting
    a, b = object(), object()
    table.update([(a, [3, 4]), (b, [7])])
    table.update([(a, [3, 4]), (b, [7, 9])])  # b grew by a block
    table.update([(a, [3, 4])])  # b finished
    table.update([(b, [5, 6])])  # a new owner of row 0: rewritten whole
    assert sent == [3, 1, 2]
    assert table.device[0, :2].tolist() == [5, 6] and table.np[0, :2].tolist() == [5, 6]
    assert table.device[1, :2].tolist() == [7, 9]


def test_padding_rows_of_a_uniform_decode(tiny_model):
    """A decode step of 3 requests laid out for a graph of 8: the padding rows write no cache
    slot (-1), attend to one key (sequence length 1), sit at position 0, and the query starts run
    on one token per row; a mixed step is never padded."""
    llm = LLM(str(tiny_model("llama")), dtype="float32", enforce_eager=True, num_kv_blocks=64)
    engine, runner = llm.engine, llm.engine.runner
    runner.step_runner.uniform_batch_size = lambda n, rows: 8 if rows == 1 and n <= 8 else None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(ragged_prompts(3, seed=9)):
        engine.add_request(llm.input_processor.make_request(str(i), prompt, params, 0, 0.0))
    prefill = engine.scheduler.schedule()
    assert not runner.prepare_inputs(prefill).uniform_decode
    assert runner.prepare_inputs(prefill).num_padded == prefill.total_num_scheduled_tokens
    output = runner.execute_model(prefill)
    engine.scheduler.update_from_output(prefill, output.sampled_token_ids)
    decode = engine.scheduler.schedule()
    inputs = runner.prepare_inputs(decode)
    assert inputs.uniform_decode and inputs.num_tokens == 3 and inputs.num_padded == 8
    assert runner.slot_mapping.device[3:8].tolist() == [-1] * 5
    assert runner.seq_lens.device[3:8].tolist() == [1] * 5
    assert runner.query_lens.device[3:8].tolist() == [1] * 5
    assert runner.positions.device[3:8].tolist() == [0] * 5
    assert runner.input_ids.device[3:8].tolist() == [0] * 5
    assert runner.query_start_loc.device[:9].tolist() == list(range(9))
    assert len(inputs.input_ids) == 8 and inputs.logits_indices.tolist() == [0, 1, 2]


def test_graph_sizes_pad_to_the_smallest_that_holds_the_batch():
    from kvik_cuda.graphs import CudaGraphStepRunner

    runner = object.__new__(CudaGraphStepRunner)
    runner._sizes, runner._piecewise_sizes = {}, []
    assert runner.uniform_batch_size(3, 1) is None  # nothing captured yet
    assert runner.padded_num_tokens(3) == 3
    runner._sizes = {1: [1, 2, 4, 8, 16], 4: [1, 2, 4]}
    assert [runner.uniform_batch_size(n, 1) for n in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, None]
    # Verifications of 1 + 3 rows a request have graphs of their own, at fewer sizes.
    assert [runner.uniform_batch_size(n, 4) for n in (1, 3, 5)] == [1, 4, None]
    assert runner.uniform_batch_size(2, 3) is None  # no graph of 3 rows a request
    assert runner.padded_num_tokens(3) == 3  # prompt tokens, no piecewise graphs: unpadded
    # Piecewise graphs (two or more tokens) take the other steps, and decodes above the FULL sizes.
    runner._piecewise_sizes = [2, 4, 8, 16, 32]
    assert [runner.padded_num_tokens(n) for n in (1, 2, 3, 9, 32, 33)] == [1, 2, 4, 16, 32, 33]


def test_full_graph_shapes_with_speculation():
    """Verification graphs: 1 + k rows a request, at the capture sizes that fit the step buffers
    and that speculate (disable_by_batch_size)."""
    from types import SimpleNamespace

    from kvik_cuda.graphs import full_graph_shapes

    def runner(k, max_num_tokens, limit=None):
        speculative = SimpleNamespace(disable_by_batch_size=limit)
        return SimpleNamespace(
            num_speculative_tokens=k,
            max_num_tokens=max_num_tokens,
            max_num_seqs=64,
            config=SimpleNamespace(speculative=speculative if k else None),
        )

    sizes = [1, 2, 4, 8, 16]
    assert full_graph_shapes(runner(0, 64), sizes) == [(1, s) for s in sizes]
    assert full_graph_shapes(runner(3, 32), sizes) == [(1, s) for s in sizes] + [
        (4, 1), (4, 2), (4, 4), (4, 8)
    ]  # fmt: skip
    assert full_graph_shapes(runner(3, 2048, limit=4), sizes)[5:] == [(4, 1), (4, 2), (4, 4)]


def test_padded_verification_layout_and_outputs(tiny_model):
    """A verification laid out for a FULL graph of 1 + k rows a request (as kvik_cuda replays
    it): a request with fewer drafts gets padding rows inside it (no cache write, positions after
    its drafts), padding requests follow, and the step's logits rows are each request's own.
    Run eagerly on that layout, greedy outputs equal those without speculation."""
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], list(range(3, 40)) * 2, [11, 17]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def make(speculative=None):
        return LLM(
            str(tiny_model("llama")), dtype="float32", enforce_eager=True, num_kv_blocks=64,
            block_size=16, speculative_config=speculative,
        )  # fmt: skip

    def generate(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    expected = generate(make())
    llm = make({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    runner = llm.engine.runner
    runner.step_runner.uniform_batch_size = lambda n, rows: 4 if n <= 4 else None
    layouts = []
    prepare = runner.prepare_inputs

    def recording(scheduler_output):
        inputs = prepare(scheduler_output)
        if inputs.uniform_query_len == 4:
            n = len(scheduler_output.scheduled)
            layouts.append(
                (
                    [len(s.spec_token_ids) for s in scheduler_output.scheduled],
                    [s.start for s in scheduler_output.scheduled],
                    runner.slot_mapping.device[:16].tolist(),
                    runner.positions.device[:16].tolist(),
                    runner.query_start_loc.device[:5].tolist(),
                    runner.query_lens.device[:4].tolist(),
                    inputs.logits_indices.tolist(),
                    (inputs.num_tokens, inputs.num_padded, n),
                    (
                        inputs.common_metadata.token_requests.tolist(),
                        inputs.common_metadata.token_seq_lens.tolist(),
                    ),
                )
            )
        return inputs

    runner.prepare_inputs = recording
    assert generate(llm) == expected
    assert llm.stats.spec_decoding.num_accepted_tokens > 0
    mixed = [layout for layout in layouts if len(set(layout[0])) > 1]
    assert mixed, "no verification step had requests with different draft counts"
    for layout in layouts:
        drafts, starts, slots, positions, query_starts, query_lens, logits_rows, sizes, rows = (
            layout
        )
        num_tokens, num_padded, n = sizes
        # Each row as a decode of its own (the Triton backend's verification): its request, and
        # the keys up to its position.
        assert rows == ([r // 4 for r in range(16)], [p + 1 for p in positions])
        assert (num_tokens, num_padded) == (4 * n, 16)
        assert query_starts == [0, 4, 8, 12, 16] and query_lens == [4, 4, 4, 4]
        expected_rows = []
        for r, (k, start) in enumerate(zip(drafts, starts)):
            rows = slice(4 * r, 4 * r + 4)
            assert positions[rows] == [start + i for i in range(4)]
            assert all(slot >= 0 for slot in slots[4 * r : 4 * r + 1 + k])
            assert slots[4 * r + 1 + k : 4 * r + 4] == [-1] * (3 - k)
            expected_rows += list(range(4 * r, 4 * r + 1 + k))
        assert slots[4 * n : 16] == [-1] * (16 - 4 * n)  # the padding requests write nothing
        assert logits_rows == expected_rows


def test_capture_sizes_and_modes():
    sizes = default_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and len(sizes) == 35
    assert default_capture_sizes(300)[-3:] == [272, 288, 300]
    assert default_capture_sizes(5) == [1, 2, 4, 5]
    assert default_capture_sizes(1000)[-1] == 512  # above 512: eager
    assert CompilationConfig(cudagraph_mode="full", cudagraph_capture_sizes=[8, 2, 2]) == (
        CompilationConfig(cudagraph_mode="full", cudagraph_capture_sizes=[2, 8])
    )
    with pytest.raises(ValueError, match="needs compilation mode 3"):
        CompilationConfig(mode=0, cudagraph_mode="full_and_piecewise", cudagraph_capture_sizes=[1])
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        CompilationConfig(cudagraph_mode="fast", cudagraph_capture_sizes=[1])
    with pytest.raises(ValueError, match="positive integers"):
        CompilationConfig(cudagraph_mode="full", cudagraph_capture_sizes=[0])
    with pytest.raises(ValueError, match="modes 1 and 2 are not built"):
        CompilationConfig(mode=1)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineArgs(enforce_eager=True, cudagraph_mode="full")._compilation_config(True, 256)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineArgs(enforce_eager=True, compilation_config='{"mode": 3}')._compilation_config(
            True, 256
        )
    # vLLM's default where there are graphs: compiled, FULL for decodes, PIECEWISE for the rest.
    gpu = EngineArgs()._compilation_config(True, 256)
    assert (gpu.mode, gpu.cudagraph_mode, gpu.full_graphs, gpu.piecewise_graphs) == (
        3,
        "full_and_piecewise",
        True,
        True,
    )
    eager = EngineArgs(enforce_eager=True)._compilation_config(True, 256)
    assert (eager.mode, eager.cudagraph_mode) == (0, "none")
    cpu = EngineArgs()._compilation_config(False, 256)
    assert (cpu.mode, cpu.cudagraph_mode) == (0, "none")
    full = EngineArgs(cudagraph_mode="full")._compilation_config(True, 256)
    assert (full.mode, full.full_graphs, full.piecewise_graphs) == (0, True, False)
    # The JSON: vLLM's keys, "level" for "mode", upper-case modes; one value given twice must agree.
    given = EngineArgs(
        compilation_config='{"level": 3, "cudagraph_mode": "PIECEWISE", "cache_dir": "/x", '
        '"cudagraph_capture_sizes": [4, 2]}'
    )._compilation_config(True, 256)
    assert (given.mode, given.cudagraph_mode, given.cache_dir) == (3, "piecewise", "/x")
    assert given.cudagraph_capture_sizes == [2, 4]
    eager_model = EngineArgs(compilation_config='{"mode": 0}')._compilation_config(True, 256)
    assert eager_model.cudagraph_mode == "full"
    # The capture sizes stop at the max_num_seqs the platform resolved (512 on an H200).
    assert gpu.cudagraph_capture_sizes[-1] == 256
    assert EngineArgs()._compilation_config(True, 512).cudagraph_capture_sizes[-2:] == [496, 512]
    for text, message in (
        ('{"mode": 3', "not valid JSON"),
        ("[3]", "must be a JSON object"),
        ('{"use_inductor": true}', r"keys \['use_inductor'\] are not supported"),
        ('{"mode": "3"}', "mode must be an integer"),
        ('{"mode": 3, "level": 0}', "both mode and level"),
        ('{"cudagraph_capture_sizes": 8}', "must be a list"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineArgs(compilation_config=text)._compilation_config(True, 256)
    with pytest.raises(ValueError, match="given twice"):
        EngineArgs(
            cudagraph_mode="full", compilation_config='{"cudagraph_mode": "none"}'
        )._compilation_config(True, 256)


def test_padding_tokens_of_a_piecewise_step(tiny_model):
    """A prompt step padded as a piecewise graph pads it (to a captured token count): the padding
    tokens write no cache slot, sit at position 0 and belong to no request (the query starts end
    at the real tokens). (Such steps run on the H200: test_gpu_graphs.py's piecewise modes.)"""
    llm = LLM(str(tiny_model("llama")), dtype="float32", enforce_eager=True, num_kv_blocks=64)
    engine, runner = llm.engine, llm.engine.runner
    runner.step_runner.padded_num_tokens = lambda n: n + 5
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(ragged_prompts(3, seed=9)):
        engine.add_request(llm.input_processor.make_request(str(i), prompt, params, 0, 0.0))
    prefill = engine.scheduler.schedule()
    n = prefill.total_num_scheduled_tokens
    inputs = runner.prepare_inputs(prefill)
    assert not inputs.uniform_decode and (inputs.num_tokens, inputs.num_padded) == (n, n + 5)
    assert len(inputs.input_ids) == n + 5
    assert runner.slot_mapping.device[n : n + 5].tolist() == [-1] * 5
    assert runner.positions.device[n : n + 5].tolist() == [0] * 5
    assert runner.query_start_loc.device[3].item() == n


@pytest.mark.parametrize(
    "limits, message",
    [
        ({"max_num_seqs": 10**9}, "GiB of step buffers"),
        ({"max_num_batched_tokens": 10**9}, "GiB of step buffers"),
        ({"num_kv_blocks": 10**9}, "the KV cache asked for, num_kv_blocks=1000000000"),
        ({"kv_cache_memory_bytes": 10**15}, "the KV cache asked for, kv_cache_memory_bytes="),
    ],
)
def test_limits_beyond_the_memory_are_refused(tiny_model, limits, message):
    """Mistyped limits are a clear error before anything is sized by them (each was the
    allocator's traceback, or a kill for memory after a minute of a 24 GB machine swapping)."""
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model("llama")), dtype="float32", enforce_eager=True, **limits)


def test_warm_up_runs_short_chunks_alone_and_after_decodes(tiny_model):
    """Once the KV cache exists, the runner runs the step shapes that the decode graphs do not
    run: chunks of 2 and 17 tokens alone and a two-token chunk after 16 decodes (the shapes that
    on the GPU take other attention launches). It leaves no request, no in-flight token, the
    sampler's RNG where it was and block 0 of every layer's cache zeroed; a greedy generation is
    the same as without it."""
    llm = LLM(
        str(tiny_model("llama")), dtype="float32", enforce_eager=True, max_model_len=96,
        num_kv_blocks=32, enable_prefix_caching=False,  # block 0 is rewritten below, mid-life
    )  # fmt: skip
    runner = llm.engine.runner
    shapes = []
    build = runner.metadata_builder.build

    def recording_build(common):
        lens = common.query_lens[: common.num_reqs].tolist()
        shapes.append((lens.count(1), common.max_query_len, common.num_leading_decodes))
        return build(common)

    runner.metadata_builder.build = recording_build
    rng = runner.sampler.generator.get_state()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ragged_prompts(3, seed=11, low=5, high=30)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    shapes.clear()
    runner.warm_up_mixed_steps()
    assert shapes == [(0, 2, 0), (0, 17, 0), (16, 2, 16)]
    assert torch.equal(runner.sampler.generator.get_state(), rng)
    assert not [r for r in runner.requests if r.startswith("warm-up")]
    assert runner._prev_sampled is None
    for layer in runner.attention_layers.values():
        assert not layer.kv_cache[:, 0].any()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
