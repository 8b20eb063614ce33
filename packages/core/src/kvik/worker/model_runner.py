"""The device-neutral model runner: one forward pass per step over every scheduled request.

A step is prepared in persistent buffers (kvik.worker.step_buffers: ids, positions, slot mapping,
query starts, sequence lengths, a fixed-width block table, sampling parameters), run by the
platform's step runner (kvik.worker.step_runner: eager, CUDA graphs, the CPU's one-call decode),
sampled on the device, and copied back to pinned host memory behind an event. ``launch`` returns as
soon as the device has the work; ``PendingStep.collect`` waits for the tokens. So the engine can
schedule step N+1 while the device runs step N: a token still in flight when step N+1 is prepared
(the last output token of a request that step N samples) is read on the device from step N's
sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from kvik import ops
from kvik.attention.backend import AttentionBackend, AttentionMetadata
from kvik.attention.kv_quant import is_fp8
from kvik.attention.selector import attach_attention
from kvik.config import kv_cache_torch_dtype
from kvik.layers.attention import Attention
from kvik.layers.logits_processors import LogitsProcessor, build_logits_processors
from kvik.layers.sampler import LogprobTensors, Sampler, SamplingBatch, logprob_tensors
from kvik.model_loader.loader import load_model
from kvik.quantization.activation import link_quantized_activations
from kvik.scheduler.output import TokenLogprobs
from kvik.spec_decode.proposer import Proposer, make_proposer
from kvik.spec_decode.rejection_sampler import RejectionSampler
from kvik.structured_output.bitmask import apply_token_bitmask
from kvik.worker.nvtx import nvtx_range
from kvik.worker.speculative_sampling import SpeculativeSampling
from kvik.worker.step_buffers import BlockTable, StagedBuffer
from kvik.worker.step_io import ModelRunnerOutput, PendingStep, StepInputs

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.request import Request
    from kvik.scheduler.output import SchedulerOutput
    from kvik.structured_output.manager import GrammarBitmask
    from kvik.worker.step_runner import StepRunner

_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass
class _RequestState:
    """What the runner keeps per request across steps."""

    processors: list[LogitsProcessor]
    # Prompt logprobs by position, gathered chunk by chunk (a recompute after preemption overwrites).
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


class ModelRunner:
    def __init__(
        self, config: EngineConfig, platform: type[Platform], device: torch.device
    ) -> None:
        """``device``: the rank's own (its worker's ``platform.device(local_rank)``)."""
        self.config = config
        self.platform = platform
        self.device = device
        self.block_size = config.cache.block_size
        model_config = config.model
        self.dtype = model_config.dtype
        self.nvtx = config.enable_nvtx
        # The layers choose their small ops' implementation as they are built (kvik.ops): this
        # engine's choice, or its platform's, for this build only.
        config.ops_dispatch = config.ops_dispatch or platform.ops_dispatch
        # What the KV cache stores: the model's dtype, or FP8 with the checkpoint's k/v scales.
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, self.dtype)
        with ops.ops_dispatch(config.ops_dispatch):
            self.model: nn.Module = load_model(
                model_config,
                self.device,
                platform,
                kv_cache_fp8=is_fp8(self.kv_cache_dtype),
            )
        platform.prepare_model(self.model, config)
        # Norms and activations write the quantized input of the linear layer they feed, where
        # its kernel takes that and the platform fuses it (kvik.quantization.activation).
        self.quantizing_producers = link_quantized_activations(self.model, platform)
        self.attention_layers: dict[str, Attention] = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        scheduler = config.scheduler
        self.max_num_seqs = scheduler.max_num_seqs
        self.max_num_batched_tokens = scheduler.max_num_batched_tokens
        # A padded decode batch holds up to max_num_seqs tokens, a step up to the token budget.
        self.max_num_tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        self.max_model_len = model_config.max_model_len
        speculative = config.speculative
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative else 0
        self._check_step_buffers_fit(platform)
        # The layers' own scale tensors are read where the cache is FP8.
        self.backend: type[AttentionBackend]
        self.backend, self.metadata_builder = attach_attention(
            self, self.attention_layers.values(), self.kv_cache_dtype
        )
        self._allocate_buffers()
        generator = torch.Generator(self.device).manual_seed(model_config.seed)
        with ops.ops_dispatch(config.ops_dispatch):
            self.sampler = Sampler(generator)
            self.rejection_sampler = RejectionSampler(generator)
        self.eos_token_ids = sorted(model_config.eos_token_ids())
        self.requests: dict[str, _RequestState] = {}
        # The last launched step's sampled tokens on the device, and each request's row in them:
        # where the next step's in-flight tokens come from.
        self._prev_sampled: Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.step_runner: StepRunner = platform.step_runner_class(config)(self)
        # The proposer of speculative decoding's drafts (None: off); a draft model or an EAGLE-3
        # head is loaded here, beside the target.
        self.proposer: Proposer | None = make_proposer(self) if speculative else None
        self.speculative = SpeculativeSampling(self) if speculative else None

    def _check_step_buffers_fit(self, platform: type[Platform]) -> None:
        """Refuse limits whose persistent step buffers (a block-table row of max_model_len for
        each of max_num_seqs, a few indices for each of the step's tokens, host and device
        copies) would not fit in the device's free memory: a mistyped max_num_seqs of 10**9 was
        killed for memory instead."""
        max_blocks = -(-self.max_model_len // self.block_size)
        per_seq = 4 * max_blocks + 64
        per_token = 48
        need = 2 * (self.max_num_seqs * per_seq + self.max_num_tokens * per_token)
        try:
            free, _ = platform.device_memory_info(self.device)
        except NotImplementedError:  # a platform that cannot tell: its allocator will
            return
        if need > free:
            gib = 1024**3
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs} and steps of up to {self.max_num_tokens} "
                f"tokens (max_num_batched_tokens) need {need / gib:.1f} GiB of step buffers (a block "
                f"table of max_model_len={self.max_model_len} for every sequence, indices for "
                f"every token), more than the {free / gib:.1f} GiB free on {self.device}: lower "
                "them"
            )

    def _allocate_buffers(self, separate: bool | None = None) -> None:
        """The persistent step buffers (``separate``: host and device copies even on the CPU, so
        that tests run the copy and scatter paths there)."""
        t, r, device = self.max_num_tokens, self.max_num_seqs, self.device

        def staged(size: int, dtype: torch.dtype, fill: int = 0) -> StagedBuffer:
            return StagedBuffer(size, dtype, device, fill, separate)

        self.input_ids = staged(t, torch.int64)
        self.positions = staged(t, torch.int64)
        self.slot_mapping = staged(t, torch.int64, fill=-1)
        self.query_start_loc = staged(r + 1, torch.int32)
        self.query_lens = staged(r, torch.int32)
        self.seq_lens = staged(r, torch.int32, fill=1)
        # A verification's rows as decodes (AttentionMetadata.token_requests, token_seq_lens).
        self.token_requests = staged(t, torch.int32)
        self.token_seq_lens = staged(t, torch.int32, fill=1)
        # One row per sampling request, and one per draft token it verifies (each a token of the
        # step, so no more than t).
        self.logits_indices = staged(min(r * (1 + self.num_speculative_tokens), t), torch.int64)
        # Rows of the flat token layout whose token is still in flight, and where it is.
        self.in_flight_rows = staged(r, torch.int64)
        self.in_flight_sources = staged(r, torch.int64)
        self.temperature = staged(r, torch.float32)
        self.top_k = staged(r, torch.int64)
        self.top_p = staged(r, torch.float32)
        self.min_p = staged(r, torch.float32)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.block_table = BlockTable(r, max_blocks, device, separate)
        on_device = device.type != "cpu"
        # Two pinned outputs, alternating: step N+1's copy must not overwrite step N's tokens
        # before they are collected.
        self._sampled_host = [torch.zeros(r, dtype=torch.int64, pin_memory=on_device) for _ in "ab"]
        self._sampled_turn = 0
        # Recorded after a step's host-to-device copies: the host waits on it before it rewrites
        # the pinned staging buffers for the next step (a copy may still be queued behind the
        # previous step's work).
        self._inputs_copied = torch.Event(device.type) if on_device else None
        self._events = on_device

    # --- KV cache -------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        per_layer = sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_size
            for layer in self.attention_layers.values()
        )
        # A draft model keeps its own cache in the same blocks.
        own = per_layer * self.kv_cache_dtype.itemsize
        return own + (self.proposer.kv_cache_bytes_per_block() if self.proposer else 0)

    def initialize_kv_cache(self, num_blocks: int, warm_up: bool = True) -> None:
        for layer in self.attention_layers.values():
            shape = self.backend.kv_cache_shape(
                num_blocks, self.block_size, layer.num_kv_heads, layer.head_size
            )
            layer.kv_cache = self.platform.zeroed_kv_cache(shape, self.kv_cache_dtype, self.device)
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)
        if warm_up:
            self.step_runner.on_kv_cache_ready()
            self.warm_up_mixed_steps()

    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """One step of ``num_tokens`` dummy prompt tokens over ``min(max_num_seqs, num_tokens)``
        requests that each sample (top-k and top-p on, the costliest sampling path), over a
        temporary KV cache of just the blocks it needs, dropped afterwards: for measuring peak
        memory before the real KV cache is sized."""
        from kvik.sampling_params import SamplingParams

        num_reqs = max(1, min(max_num_seqs, num_tokens))
        num_tokens = min(num_tokens, num_reqs * max_model_len)
        lens = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
        blocks = [-(-n // self.block_size) for n in lens]
        self.initialize_kv_cache(sum(blocks), warm_up=False)
        try:
            self._dummy_step("profile", lens, blocks, params)
        finally:
            self.release_kv_cache()

    def release_kv_cache(self) -> None:
        """Drop the KV cache (the model's and a proposer's). The engine's shutdown does it: the
        runner's objects hold reference cycles, so without it the cache (gigabytes) lived on
        after its LLM was deleted until the cyclic collector's next full collection."""
        for layer in self.attention_layers.values():
            layer.kv_cache = None
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(0)

    def warm_up_mixed_steps(self) -> None:
        """Dummy steps of the shapes a scheduler makes that the decode graphs do not run (nor the
        profiling step, which a given ``num_kv_blocks`` skips): a prompt chunk of two tokens and
        one of 17 alone, and a two-token chunk after 16 decodes. Kernels whose launch depends on
        the step's shape (on the GPU: attention takes 16-row programs for queries of up to a few
        tokens, 64-row ones past 16, and runs 16 or more leading decodes in a launch of their
        own) compile here, not inside a request: on the H200 a server whose chunked prompts left
        a last chunk of a few tokens compiled a paged-attention variant mid-run, and the ~25
        requests queued behind it waited 0.5-1.2 s (docs/benchmarks.md, the twenty-eighth
        session). Every dummy token goes to block 0, zeroed after."""
        from kvik.sampling_params import SamplingParams

        if not self.attention_layers:
            return
        decodes = min(16, self.max_num_seqs - 1)
        layouts = [[2], [17], [1] * decodes + [2]] if decodes > 0 else [[2], [17]]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        for lens in layouts:
            if sum(lens) > self.max_num_batched_tokens or max(lens) > self.max_model_len:
                continue  # a step this engine never makes
            blocks = [-(-n // self.block_size) for n in lens]
            self._dummy_step("warm-up", lens, blocks, params, share_block=True)
        for layer in self.attention_layers.values():
            layer.kv_cache[:, 0].zero_()

    def _dummy_step(
        self,
        name: str,
        lens: list[int],
        blocks: list[int],
        params,
        share_block: bool = False,
    ) -> None:
        """One synchronous step of dummy prompts of ``lens`` tokens (``blocks`` KV blocks each,
        consecutive from block 0, or all in block 0 with ``share_block``), every request
        sampling once with ``params``; nothing of it stays in the runner, and the sampler's RNG
        does not move."""
        from kvik.request import Request
        from kvik.scheduler.output import ScheduledRequest, SchedulerOutput

        vocab = self.config.model.vocab_size
        scheduled, next_block = [], 0
        for i, (n, num_blocks) in enumerate(zip(lens, blocks)):
            request = Request(f"{name}-{i}", [(7 * i + j) % vocab for j in range(n)], params, 1)
            if share_block:
                block_ids = [0] * num_blocks
            else:
                block_ids = list(range(next_block, next_block + num_blocks))
                next_block += num_blocks
            scheduled.append(ScheduledRequest(request, 0, n, block_ids, True))
        rng_state = self.sampler.generator.get_state()  # the dummy step must not move the RNG
        try:
            self.execute_model(SchedulerOutput(scheduled, sum(lens)))
        finally:
            self.sampler.generator.set_state(rng_state)
            for s in scheduled:
                self.requests.pop(s.request.request_id, None)
            self._prev_sampled, self._prev_rows = None, {}
            if self.proposer is not None:
                for s in scheduled:
                    self.proposer.drop(s.request.request_id)

    # --- one step -------------------------------------------------------------------------
    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Fill the persistent buffers for the step and copy them to the device, once each."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()  # the previous step's copies have left the buffers
        scheduled = scheduler_output.scheduled
        num_reqs = len(scheduled)
        starts = np.empty(num_reqs, dtype=np.int64)
        lens = np.empty(num_reqs, dtype=np.int64)
        token_ids: list[int] = []
        in_flight: list[tuple[int, int]] = []  # (flat row, row in the previous step's tokens)
        sample_rows: list[int] = []
        drafts: list[tuple[int, ...]] = []
        # Per sampling request, the output index of the first token it samples (a seeded
        # request's draws depend on it): the one after its known tokens and the token in flight,
        # if any; for a verification, its first scored position (before its drafts').
        first_outputs: list[int] = []
        table_rows: list[tuple[object, list[int]]] = []
        needs_hidden = False
        for r, s in enumerate(scheduled):
            request = s.request
            start, n = s.start, s.num_tokens
            starts[r], lens[r] = start, n
            known = request.all_token_ids
            if s.spec_token_ids:
                # A verification: the known tokens, then the drafts after the last one.
                token_ids.extend(known[start:])
                token_ids.extend(s.spec_token_ids)
            elif start + n <= len(known):
                if n == 1:
                    token_ids.append(known[start])
                else:
                    token_ids.extend(known[start : start + n])
            else:
                # The request's last token is still in flight: the previous step samples it.
                token_ids.extend(known[start:])
                token_ids.append(0)
                in_flight.append((len(token_ids) - 1, self._in_flight_source(request)))
            if s.samples:
                sample_rows.append(r)
                drafts.append(s.spec_token_ids)
                first_outputs.append(start + n - len(s.spec_token_ids) - request.num_prompt_tokens)
            table_rows.append(((request, request.num_preemptions), s.block_ids))
            if request.sampling_params.prompt_logprobs is not None and (
                start < request.num_prompt_tokens - 1
            ):
                needs_hidden = True
        num_tokens = len(token_ids)
        query_len = self._uniform_query_len(scheduled, lens, starts, sample_rows, needs_hidden)
        padded_reqs = (
            self.step_runner.uniform_batch_size(num_reqs, query_len) if query_len else None
        )
        if padded_reqs is None:
            query_len = 0  # no graph takes it: laid out as it comes, padded for piecewise graphs
            padded_reqs = num_reqs
            padded = self.step_runner.padded_num_tokens(num_tokens)
            rows_of = lens
        else:
            padded = padded_reqs * query_len
            rows_of = np.full(num_reqs, query_len, dtype=np.int64)

        query_start_loc = self.query_start_loc.np
        query_start_loc[0] = 0
        np.cumsum(rows_of, out=query_start_loc[1 : num_reqs + 1])
        laid_out = int(query_start_loc[num_reqs])  # rows of the scheduled requests
        # Row i of request r sits at position starts[r] + i; rows past a request's tokens (a
        # verification with fewer drafts than its graph's query length) are padding in it.
        if laid_out == num_reqs:
            positions = starts
            token_request = None
        else:
            token_request = np.repeat(np.arange(num_reqs), rows_of)
            offsets = np.arange(laid_out) - np.repeat(query_start_loc[:num_reqs], rows_of)
            positions = offsets + np.repeat(starts, rows_of)
        self.block_table.update(table_rows)
        bs = self.block_size
        table = self.block_table.np
        rows = np.arange(num_reqs) if token_request is None else token_request
        slots = table[rows, positions // bs] * bs + positions % bs
        ids = np.asarray(token_ids, dtype=np.int64)
        if laid_out != num_tokens:  # padding inside requests: no cache write, token 0
            real = offsets < np.repeat(lens, rows_of)
            slots = np.where(real, slots, -1)
            real_rows = np.flatnonzero(real)
            ids = np.zeros(laid_out, dtype=np.int64)
            ids[real_rows] = token_ids
            in_flight = [(int(real_rows[row]), source) for row, source in in_flight]
        self.slot_mapping.np[:laid_out] = slots
        self.input_ids.np[:laid_out] = ids
        self.positions.np[:laid_out] = positions
        self.query_lens.np[:num_reqs] = rows_of
        self.seq_lens.np[:num_reqs] = starts + rows_of
        if padded > laid_out:  # padding rows: no cache write, position 0
            self.input_ids.np[laid_out:padded] = 0
            self.positions.np[laid_out:padded] = 0
            self.slot_mapping.np[laid_out:padded] = -1
            if query_len:  # padding requests of query_len tokens each, over harmless keys
                self.query_lens.np[num_reqs:padded_reqs] = query_len
                self.seq_lens.np[num_reqs:padded_reqs] = query_len
                self.positions.np[laid_out:padded] = np.tile(
                    np.arange(query_len), padded_reqs - num_reqs
                )
                query_start_loc[num_reqs + 1 : padded_reqs + 1] = np.arange(
                    laid_out + query_len, padded + 1, query_len
                )
            # Else (a piecewise step) the padding tokens belong to no request: attention's
            # programs past the last request's tokens return, and their rows are never read.
        num_logits = len(sample_rows)
        decode_requests = token_requests = token_seq_lens = None
        if any(drafts):
            # A verification (the newest token, then drafts) is computed as decodes are: each
            # row with its request and the keys up to its own position.
            spec_lens = np.array([len(s.spec_token_ids) for s in scheduled], dtype=np.int64)
            decode = (lens - spec_lens == 1) | (lens == 1)
            decode_requests = torch.from_numpy(
                np.pad(decode, (0, padded_reqs - num_reqs), constant_values=True)
            )
            row_requests = self.token_requests.np
            if query_len:  # uniform: query_len rows a request, padding requests included
                row_requests[:padded] = np.arange(padded) // query_len
            else:  # padding rows after the requests' belong to none: request 0's, unread
                row_requests[:laid_out] = (
                    np.arange(num_reqs) if token_request is None else token_request
                )
                row_requests[laid_out:padded] = 0
            self.token_seq_lens.np[:padded] = self.positions.np[:padded] + 1
            token_requests = self.token_requests.upload(padded)
            token_seq_lens = self.token_seq_lens.upload(padded)
            # Each sampling request scores its first k_i + 1 rows after its known tokens: its
            # drafts' and the one after.
            ends = query_start_loc[:num_reqs][sample_rows] + lens[sample_rows]
            counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
            num_logits = int(counts.sum())
            offsets = np.arange(num_logits) - np.repeat(np.cumsum(counts) - counts, counts)
            self.logits_indices.np[:num_logits] = np.repeat(ends - counts, counts) + offsets
        else:
            self.logits_indices.np[:num_logits] = (
                query_start_loc[:num_reqs][sample_rows] + lens[sample_rows] - 1
            )

        input_ids = self.input_ids.upload(padded)
        if in_flight:
            n = len(in_flight)
            flat_rows, sources = zip(*in_flight)
            self.in_flight_rows.np[:n] = flat_rows
            self.in_flight_sources.np[:n] = sources
            input_ids.index_copy_(
                0,
                self.in_flight_rows.upload(n),
                self._prev_sampled.index_select(0, self.in_flight_sources.upload(n)),
            )
        common = AttentionMetadata(
            num_actual_tokens=padded,
            num_reqs=padded_reqs,
            query_start_loc=self.query_start_loc.upload(padded_reqs + 1),
            query_lens=self.query_lens.upload(padded_reqs),
            seq_lens=self.seq_lens.upload(padded_reqs),
            block_table=self.block_table.device[:padded_reqs],
            slot_mapping=self.slot_mapping.upload(padded),
            max_query_len=int(rows_of.max()),
            max_seq_len=int((starts + rows_of).max()),
            block_size=bs,
            decode_requests=decode_requests,
            token_requests=token_requests,
            token_seq_lens=token_seq_lens,
            num_leading_decodes=leading_decodes(rows_of),
        )
        sampling_requests = [scheduled[r].request for r in sample_rows]
        inputs = StepInputs(
            input_ids=input_ids,
            positions=self.positions.upload(padded),
            attn_metadata=self.metadata_builder.build(common),
            logits_indices=self.logits_indices.upload(num_logits),
            num_tokens=laid_out,
            num_padded=padded,
            uniform_query_len=query_len,
            query_starts=query_start_loc[:num_reqs].tolist(),
            sampling_requests=sampling_requests,
            sampling=(
                self._sampling_batch(sampling_requests, first_outputs)
                if sampling_requests
                else None
            ),
            draft_token_ids=drafts,
            common_metadata=common,
        )
        # Every pinned staging buffer of this step has had its copy queued: the next step's
        # prepare waits for this event (not for the step's compute) before rewriting them.
        self._record_inputs_copied()
        return inputs

    def _uniform_query_len(
        self,
        scheduled: list,
        lens: np.ndarray,
        starts: np.ndarray,
        sample_rows: list[int],
        needs_hidden: bool,
    ) -> int:
        """The rows per request of a step that a FULL graph could take: 1 when every request
        decodes one token, 1 + num_speculative_tokens when every request scores its newest token
        and at most that many drafts (the rows past a request's drafts become padding, within
        max_model_len); 0 for any other step."""
        num_reqs = len(scheduled)
        if needs_hidden or len(sample_rows) != num_reqs:
            return 0
        if int(lens.sum()) == num_reqs:
            return 1
        k = self.num_speculative_tokens
        if not k or int(starts.max()) + 1 + k > self.max_model_len:
            return 0
        for s, n in zip(scheduled, lens.tolist()):
            if n != 1 + len(s.spec_token_ids):
                return 0
        return 1 + k

    def dummy_decode_inputs(self, size: int, query_len: int = 1) -> StepInputs:
        """A uniform step of ``size`` padding requests of ``query_len`` rows each (no cache write,
        keys from block 0), laid out in the persistent buffers as a real one would be: for
        capturing graphs (``query_len`` 1: a decode; 1 + k: a verification of k drafts)."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        t = size * query_len
        self.input_ids.np[:t] = 0
        self.positions.np[:t] = np.tile(np.arange(query_len), size)
        self.slot_mapping.np[:t] = -1
        self.query_lens.np[:size] = query_len
        self.seq_lens.np[:size] = query_len
        self.query_start_loc.np[: size + 1] = np.arange(0, t + 1, query_len)
        self.logits_indices.np[:t] = np.arange(t)
        num_blocks = -(-query_len // self.block_size)
        self.block_table.np[:size, :num_blocks] = 0
        self.block_table.device[:size, :num_blocks] = 0
        self.block_table.forget()
        token_requests = token_seq_lens = None
        if query_len > 1:  # a verification's rows as decodes (prepare_inputs)
            self.token_requests.np[:t] = np.arange(t) // query_len
            self.token_seq_lens.np[:t] = self.positions.np[:t] + 1
            token_requests = self.token_requests.upload(t)
            token_seq_lens = self.token_seq_lens.upload(t)
        common = AttentionMetadata(
            num_actual_tokens=t,
            num_reqs=size,
            query_start_loc=self.query_start_loc.upload(size + 1),
            query_lens=self.query_lens.upload(size),
            seq_lens=self.seq_lens.upload(size),
            block_table=self.block_table.device[:size],
            slot_mapping=self.slot_mapping.upload(t),
            max_query_len=query_len,
            max_seq_len=query_len,
            block_size=self.block_size,
            decode_requests=torch.ones(size, dtype=torch.bool) if query_len > 1 else None,
            token_requests=token_requests,
            token_seq_lens=token_seq_lens,
        )
        inputs = StepInputs(
            input_ids=self.input_ids.upload(t),
            positions=self.positions.upload(t),
            attn_metadata=self.metadata_builder.build(common),
            logits_indices=self.logits_indices.upload(t),
            num_tokens=t,
            num_padded=t,
            uniform_query_len=query_len,
            query_starts=list(range(0, t, query_len)),
            sampling_requests=[],
        )
        self._record_inputs_copied()
        return inputs

    def _in_flight_source(self, request: Request) -> int:
        row = self._prev_rows.get(request.request_id)
        if row is None or self._prev_sampled is None:
            raise RuntimeError(
                f"request {request.request_id}: a scheduled token is neither known nor sampled by "
                "the previous step (the scheduler may put at most one token in flight)"
            )
        return row

    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> Tensor:
        """The model's hidden states [T, hidden] for a prepared step, eagerly (for tests and tools
        that want more than the sampled rows)."""
        hidden = self.step_runner.eager_hidden(inputs)
        return hidden[: inputs.num_tokens]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, synchronously: ``launch`` then ``collect``."""
        return self.launch(scheduler_output).collect()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Start a step on the device and return without waiting for it. Tokens of the step that
        are not known yet (at or past ``len(request.all_token_ids)``: a request's last output
        token, sampled by the previous launched step and not yet collected) are read on the
        device from that step's sampled tokens."""
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
            if self.proposer is not None:
                self.proposer.drop(request_id)
        if not scheduler_output.scheduled:
            return PendingStep()
        with nvtx_range("prepare", self.nvtx):
            inputs = self.prepare_inputs(scheduler_output)
        with nvtx_range("forward", self.nvtx):
            if self.proposer is not None:
                hidden, logits = self.proposer.run_target(inputs)
            else:
                hidden, logits = self.step_runner.forward(inputs)
        finishers: list[Callable[[ModelRunnerOutput], None]] = []
        if hidden is not None:
            self._prompt_logprobs(scheduler_output, inputs, hidden, finishers)
        if self.speculative is not None:
            self._prev_sampled, self._prev_rows = None, {}  # no in-flight tokens: synchronous
            return self.speculative.step(scheduler_output, inputs, logits, finishers)
        requests = inputs.sampling_requests
        if not requests:
            return PendingStep(finishers=finishers)
        if scheduler_output.grammar_bitmask is not None:
            self.apply_grammar_bitmask(logits, requests, scheduler_output.grammar_bitmask)
        with nvtx_range("sample", self.nvtx):
            sampled = self.sample(logits, requests, inputs.sampling, finishers)
        sampled_host = self._sampled_host[self._sampled_turn]
        self._sampled_turn ^= 1
        sampled_host[: len(requests)].copy_(sampled, non_blocking=True)
        done = None
        if self._events:
            done = torch.Event(self.device.type)
            done.record()
        self._prev_sampled = sampled
        self._prev_rows = {r.request_id: row for row, r in enumerate(requests)}
        return PendingStep(requests, sampled_host, done, finishers)

    def apply_grammar_bitmask(
        self,
        logits: Tensor,
        requests: list[Request],
        grammar: GrammarBitmask,
        first_rows: list[int] | None = None,
    ) -> None:
        """Structured outputs: forbid, in the sampling rows' logits, what each request's grammar
        does not allow next. Before sampling and before logprobs, as vLLM does, so logprobs are
        those of the constrained distribution. ``first_rows``: each request's first logits row
        where not its index (a speculative step: a request that verifies k drafts has k + 1 rows,
        and so many mask rows, one per scored position)."""
        at = first_rows if first_rows is not None else range(len(requests))
        row_of = {r.request_id: at[row] for row, r in enumerate(requests)}
        rows = [
            row_of[request_id] + offset
            for request_id, count in zip(grammar.request_ids, grammar.row_counts(), strict=True)
            for offset in range(count)
        ]
        bitmask = grammar.bitmask
        if rows != sorted(rows):
            order = sorted(range(len(rows)), key=rows.__getitem__)
            rows, bitmask = [rows[i] for i in order], bitmask[order]
        bitmask = bitmask.to(logits.device, non_blocking=True)
        whole = len(rows) == logits.shape[0]  # distinct rows, sorted: then 0 .. N - 1
        apply_token_bitmask(logits, bitmask, None if whole else rows)

    def _record_inputs_copied(self) -> None:
        if self._inputs_copied is not None:
            self._inputs_copied.record()

    def sample(
        self,
        logits: Tensor,
        requests: list[Request],
        batch: SamplingBatch,
        finishers: list[Callable[[ModelRunnerOutput], None]],
    ) -> Tensor:
        wanted = [r.sampling_params.logprobs for r in requests]
        # Logprobs come from the raw logits, before processors and temperature (vLLM's default).
        raw_logprobs = logits.log_softmax(-1) if any(w is not None for w in wanted) else None
        sampled = self.sampler(logits, batch)
        if raw_logprobs is not None:
            rows = [i for i, w in enumerate(wanted) if w is not None]
            index = torch.tensor(rows, device=logits.device) if len(rows) < len(wanted) else None
            chosen = raw_logprobs if index is None else raw_logprobs[index]
            tokens = sampled if index is None else sampled[index]
            tensors = logprob_tensors(chosen, tokens, [wanted[i] for i in rows])
            ids = [requests[i].request_id for i in rows]

            def finish(output: ModelRunnerOutput) -> None:
                for request_id, entry in zip(ids, tensors.to_lists()):
                    output.logprobs[request_id] = [entry]

            finishers.append(finish)
        return sampled

    def _prompt_logprobs(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        hidden: Tensor,
        finishers: list[Callable[[ModelRunnerOutput], None]],
    ) -> None:
        """Logprobs of each prompt token given the ones before it, for requests that ask: computed
        now on the device, read and assembled when the step is collected."""
        for s, first_row in zip(scheduler_output.scheduled, inputs.query_starts):
            request = s.request
            num_top = request.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            state = self._state(request)
            prompt_len = request.num_prompt_tokens
            # Position p predicts prompt token p + 1; the last prompt position predicts output.
            end = min(s.start + s.num_tokens, prompt_len - 1)
            tensors: LogprobTensors | None = None
            if end > s.start:
                rows = torch.arange(first_row, first_row + end - s.start, device=hidden.device)
                targets = torch.tensor(
                    request.prompt_token_ids[s.start + 1 : end + 1], device=hidden.device
                )
                logprobs = self.model.compute_logits(hidden[rows]).float().log_softmax(-1)
                tensors = logprob_tensors(logprobs, targets, [num_top] * len(targets))
            completes = s.start + s.num_tokens >= prompt_len and not state.prompt_logprobs_sent
            if completes:
                state.prompt_logprobs_sent = True
            finishers.append(_PromptLogprobsFinisher(request, state, s.start, tensors, completes))

    def _state(self, request: Request) -> _RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            state = _RequestState(build_logits_processors(request))
            self.requests[request.request_id] = state
        return state

    def _sampling_batch(
        self, requests: list[Request], first_outputs: list[int] | None = None
    ) -> SamplingBatch:
        """``first_outputs``: per request, the output index of the first token it samples (by
        default the one after its known outputs: a step with no token in flight and no drafts)."""
        if first_outputs is None:
            first_outputs = [r.num_output_tokens for r in requests]
        n = len(requests)
        params = [r.sampling_params for r in requests]
        all_greedy = all(p.is_greedy for p in params)
        if all_greedy:
            # Greedy rows read none of the per-row settings: no copies for them.
            empty = self.temperature.device[:0]
            batch = SamplingBatch(empty, empty, empty, empty, all_greedy=True)
        else:
            # Capped at float32's largest: above it the cast gives inf, and a masked logit (-inf)
            # divided by inf is NaN, which the sampler would pick.
            self.temperature.np[:n] = [min(p.temperature, _FLOAT32_MAX) for p in params]
            self.top_k.np[:n] = [p.top_k for p in params]
            self.top_p.np[:n] = [p.top_p for p in params]
            self.min_p.np[:n] = [p.min_p for p in params]
            batch = SamplingBatch(
                temperature=self.temperature.upload(n),
                top_k=self.top_k.upload(n),
                top_p=self.top_p.upload(n),
                min_p=self.min_p.upload(n),
                all_greedy=False,
                use_top_k=any(p.top_k > 0 for p in params),
                use_top_p=any(p.top_p < 1.0 for p in params),
                use_min_p=any(p.min_p > 0 for p in params),
            )
        for row, request in enumerate(requests):
            state = self._state(request)
            p = params[row]
            if p.seed is not None and not p.is_greedy:  # greedy rows draw nothing
                batch.seeds[row] = (p.seed, first_outputs[row])
            if state.processors:
                batch.processors.append((row, state.processors, request.output_token_ids))
        return batch


class _PromptLogprobsFinisher:
    """At collect: store a chunk's prompt logprobs by position, and hand out the whole list once
    the prompt is done (a recompute after preemption overwrites positions)."""

    def __init__(
        self,
        request: Request,
        state: _RequestState,
        start: int,
        tensors: LogprobTensors | None,
        completes: bool,
    ) -> None:
        self.request, self.state, self.start = request, state, start
        self.tensors, self.completes = tensors, completes

    def __call__(self, output: ModelRunnerOutput) -> None:
        if self.tensors is not None:
            for offset, entry in enumerate(self.tensors.to_lists()):
                self.state.prompt_logprobs[self.start + offset] = entry
        if self.completes:
            output.prompt_logprobs[self.request.request_id] = [
                self.state.prompt_logprobs[p] for p in range(self.request.num_prompt_tokens - 1)
            ]


def leading_decodes(rows_of: np.ndarray) -> int:
    """How many requests at the front of the step have one query row each."""
    longer = np.flatnonzero(rows_of != 1)
    return int(longer[0]) if len(longer) else len(rows_of)
