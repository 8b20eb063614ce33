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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from kvik import ops
from kvik.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec
from kvik.attention.kv_quant import is_fp8
from kvik.attention.selector import select_attention_backend
from kvik.config import kv_cache_torch_dtype
from kvik.layers.attention import Attention
from kvik.layers.logits_processors import LogitsProcessor, build_logits_processors
from kvik.layers.sampler import LogprobTensors, Sampler, SamplingBatch, logprob_tensors
from kvik.model_loader.loader import load_model
from kvik.scheduler.output import TokenLogprobs
from kvik.spec_decode.proposer import Proposer, make_proposer
from kvik.spec_decode.rejection_sampler import RejectionSampler
from kvik.structured_output.bitmask import apply_token_bitmask
from kvik.worker.nvtx import nvtx_range
from kvik.worker.step_buffers import BlockTable, StagedBuffer

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.request import Request
    from kvik.scheduler.output import SchedulerOutput
    from kvik.structured_output.manager import GrammarBitmask
    from kvik.worker.step_runner import StepRunner


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Complete prompt logprobs of requests whose prompt finished computing in this step.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: the drafts proposed for each request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepInputs:
    """One prepared step: views of the runner's persistent device buffers."""

    input_ids: Tensor  # [T_pad]
    positions: Tensor  # [T_pad]
    attn_metadata: object  # the backend's metadata
    logits_indices: Tensor  # [sum(k_i + 1)] rows of the hidden states that sample
    #: T, the rows of the scheduled requests (``query_starts`` index them); rows T..T_pad are
    #: padding. A request's rows are its scheduled tokens, then (in a uniform verification) rows
    #: of padding up to ``uniform_query_len``.
    num_tokens: int
    num_padded: int  # T_pad
    #: Every request has this many rows and samples, and none needs prompt logprobs: 1 for a
    #: decode, 1 + k for a verification of up to k drafts a request; a step that a FULL CUDA graph
    #: of the step runner replays (``StepRunner.uniform_batch_size``). 0: any other step.
    uniform_query_len: int
    query_starts: list[int]  # [R] first row of each scheduled request
    sampling_requests: list[Request]  # the N requests that sample, in row order
    #: Their settings, staged with the other inputs (None when nothing samples).
    sampling: SamplingBatch | None = None
    #: Speculative decoding: per sampling request, its draft tokens scored in this step (each
    #: request's logits rows are its drafts' positions, then the position after them).
    draft_token_ids: list[tuple[int, ...]] = field(default_factory=list)
    #: The backend-neutral metadata the backend's was built from (a draft model builds its own).
    common_metadata: AttentionMetadata | None = None

    @property
    def uniform_decode(self) -> bool:
        return self.uniform_query_len == 1

    @property
    def num_draft_tokens(self) -> list[int]:
        return [len(d) for d in self.draft_token_ids]

    @property
    def has_drafts(self) -> bool:
        return any(self.draft_token_ids)

    @property
    def num_sampling(self) -> int:
        return len(self.sampling_requests)


class PendingStep:
    """A launched step. ``collect()`` waits for its sampled tokens (the one host-device sync of a
    step) and reads what the device computed into a ``ModelRunnerOutput``."""

    def __init__(
        self,
        requests: list[Request] | None = None,
        sampled_host: Tensor | None = None,
        done: object | None = None,
        finishers: list[Callable[[ModelRunnerOutput], None]] | None = None,
        output: ModelRunnerOutput | None = None,
    ) -> None:
        """``output``: a step already read back (speculative decoding's, which proposes the
        next step's drafts from the tokens it accepted)."""
        self._requests = requests or []
        self._sampled_host = sampled_host  # pinned [>= N] int64
        self._done = done  # a device event recorded after the copy to sampled_host; None: ready
        self._finishers = finishers or []
        self._output: ModelRunnerOutput | None = output

    def ready(self) -> bool:
        """Whether ``collect()`` would return without waiting for the device."""
        return self._output is not None or self._done is None or self._done.query()

    def collect(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        if self._done is not None:
            self._done.synchronize()
        output = ModelRunnerOutput()
        if self._requests:
            tokens = self._sampled_host[: len(self._requests)].tolist()
            for request, token in zip(self._requests, tokens):
                output.sampled_token_ids[request.request_id] = [token]
        for finish in self._finishers:  # logprobs, read now that the device is done
            finish(output)
        self._output = output
        return output


@dataclass
class _RequestState:
    """What the runner keeps per request across steps."""

    generator: torch.Generator | None
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
        self.attention_layers: dict[str, Attention] = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        first = next(iter(self.attention_layers.values()))
        self.backend: type[AttentionBackend] = select_attention_backend(
            platform, self.dtype, first.head_size, self.block_size, self.kv_cache_dtype
        )
        for layer in self.attention_layers.values():
            layer.impl = self.backend.impl_class()(
                layer.num_heads,
                layer.head_size,
                layer.scale,
                layer.num_kv_heads,
                layer.sliding_window,
            )
            # The layer's own scale tensors (read where the cache is FP8), set after construction
            # so that an impl whose __init__ predates them still builds.
            layer.impl.k_scale, layer.impl.v_scale = layer.k_scale, layer.v_scale
        scheduler = config.scheduler
        self.max_num_seqs = scheduler.max_num_seqs
        # A padded decode batch holds up to max_num_seqs tokens, a step up to the token budget.
        self.max_num_tokens = max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        self.max_model_len = model_config.max_model_len
        speculative = config.speculative
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative else 0
        self.metadata_builder = self.backend.builder_class()(
            self.backend,
            AttentionSpec(
                num_heads=first.num_heads,
                num_kv_heads=first.num_kv_heads,
                head_size=first.head_size,
                dtype=self.dtype,
                block_size=self.block_size,
                max_num_seqs=self.max_num_seqs,
                max_num_tokens=self.max_num_tokens,
                max_model_len=self.max_model_len,
                device=self.device,
            ),
        )
        self._allocate_buffers()
        generator = torch.Generator(self.device).manual_seed(model_config.seed)
        self.sampler = Sampler(generator)
        self.eos_token_ids = sorted(model_config.eos_token_ids())
        self.requests: dict[str, _RequestState] = {}
        # The last launched step's sampled tokens on the device, and each request's row in them:
        # where the next step's in-flight tokens come from.
        self._prev_sampled: Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.step_runner: StepRunner = platform.step_runner_class(config)(self)
        self.rejection_sampler = RejectionSampler(generator)
        # The proposer of speculative decoding's drafts (None: off); a draft model or an EAGLE-3
        # head is loaded here, beside the target.
        self.proposer: Proposer | None = make_proposer(self) if speculative else None

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
        # One row per sampling request, and one per draft token it verifies.
        self.logits_indices = staged(r * (1 + self.num_speculative_tokens), torch.int64)
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
            # Zeros, not empty: masked-out slots still meet a zero attention weight, and 0 * NaN
            # from uninitialised memory would poison the sum.
            layer.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        if self.proposer is not None:
            self.proposer.initialize_kv_cache(num_blocks)
        if warm_up:
            self.step_runner.on_kv_cache_ready()

    def profile_run(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """One step of ``num_tokens`` dummy prompt tokens over ``min(max_num_seqs, num_tokens)``
        requests that each sample (top-k and top-p on, the costliest sampling path), over a
        temporary KV cache of just the blocks it needs, dropped afterwards: for measuring peak
        memory before the real KV cache is sized."""
        from kvik.request import Request
        from kvik.sampling_params import SamplingParams
        from kvik.scheduler.output import ScheduledRequest, SchedulerOutput

        num_reqs = max(1, min(max_num_seqs, num_tokens))
        num_tokens = min(num_tokens, num_reqs * max_model_len)
        lens = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
        vocab = self.config.model.vocab_size
        scheduled, next_block = [], 0
        for i, n in enumerate(lens):
            request = Request(f"profile-{i}", [(7 * i + j) % vocab for j in range(n)], params, 1)
            num_blocks = -(-n // self.block_size)
            block_ids = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            scheduled.append(ScheduledRequest(request, 0, n, block_ids, True))
        self.initialize_kv_cache(next_block, warm_up=False)
        rng_state = self.sampler.generator.get_state()  # the dummy step must not move the RNG
        try:
            self.execute_model(SchedulerOutput(scheduled, num_tokens))
        finally:
            self.sampler.generator.set_state(rng_state)
            for s in scheduled:
                self.requests.pop(s.request.request_id, None)
            self._prev_sampled, self._prev_rows = None, {}
            for layer in self.attention_layers.values():
                layer.kv_cache = None
            if self.proposer is not None:
                self.proposer.initialize_kv_cache(0)
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
        decode_requests = None
        if any(drafts):
            # A verification (the newest token, then drafts) is computed as decodes are.
            spec_lens = np.array([len(s.spec_token_ids) for s in scheduled], dtype=np.int64)
            decode = (lens - spec_lens == 1) | (lens == 1)
            decode_requests = torch.from_numpy(
                np.pad(decode, (0, padded_reqs - num_reqs), constant_values=True)
            )
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
            sampling=self._sampling_batch(sampling_requests) if sampling_requests else None,
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
        if self.proposer is not None:
            return self._speculative_step(scheduler_output, inputs, logits, finishers)
        requests = inputs.sampling_requests
        if not requests:
            return PendingStep(finishers=finishers)
        if scheduler_output.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, requests, scheduler_output.grammar_bitmask)
        with nvtx_range("sample", self.nvtx):
            sampled = self._sample(logits, requests, inputs.sampling, finishers)
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

    def _speculative_step(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        logits: Tensor | None,
        finishers: list[Callable[[ModelRunnerOutput], None]],
    ) -> PendingStep:
        """The step's tokens with speculative decoding (synchronous: the drafts of the next step
        are proposed from the tokens accepted in this one). A step that verifies drafts goes
        through the rejection sampler; one without drafts samples as usual."""
        output = ModelRunnerOutput()
        requests = inputs.sampling_requests
        if requests:
            first_rows = self._first_logits_rows(inputs)
            if scheduler_output.grammar_bitmask is not None:
                self._apply_grammar_bitmask(
                    logits, requests, scheduler_output.grammar_bitmask, first_rows
                )
            with nvtx_range("sample", self.nvtx):
                if inputs.has_drafts:
                    tokens = self._verify(logits, requests, inputs, first_rows, finishers)
                else:
                    sampled = self._sample(logits, requests, inputs.sampling, finishers)
                    tokens = [[t] for t in sampled.tolist()]
            for request, new in zip(requests, tokens, strict=True):
                output.sampled_token_ids[request.request_id] = new
        for finish in finishers:
            finish(output)
        self._prev_sampled, self._prev_rows = None, {}
        with nvtx_range("propose", self.nvtx):
            output.spec_token_ids = self.proposer.propose(
                scheduler_output,
                inputs,
                output.sampled_token_ids,
                self._proposal_caps(inputs, output.sampled_token_ids),
            )
        return PendingStep(output=output)

    @staticmethod
    def _first_logits_rows(inputs: StepInputs) -> list[int]:
        """Each sampling request's first row in the step's logits (its k_i + 1 rows follow)."""
        rows, row = [], 0
        for k in inputs.num_draft_tokens:
            rows.append(row)
            row += k + 1
        return rows

    def _verify(
        self,
        logits: Tensor,
        requests: list[Request],
        inputs: StepInputs,
        first_rows: list[int],
        finishers: list[Callable[[ModelRunnerOutput], None]],
    ) -> list[list[int]]:
        """Rejection-sample a step that scored drafts: per request, its accepted drafts and one
        token more. Logits processors (penalties, biases, min-tokens) run at each scored position
        over the history it follows. A request with logprobs gets them at each scored position
        (raw, before processors, as a plain step's), kept for its accepted tokens."""
        batch = inputs.sampling
        wanted = [r.sampling_params.logprobs for r in requests]
        counts = [k + 1 for k in inputs.num_draft_tokens]
        logprob_rows = [i for i, w in enumerate(wanted) if w is not None]
        scored = [(i, j) for i in logprob_rows for j in range(counts[i])]
        raw_logprobs = None
        if scored:
            index = torch.tensor([first_rows[i] + j for i, j in scored], device=logits.device)
            raw_logprobs = logits[index].log_softmax(-1)
        for row, processors, output_ids in batch.processors:
            # Scored position j follows the request's output and its first j drafts: each
            # position's processors see that history (as a plain step would, had the drafts
            # been sampled).
            drafted = inputs.draft_token_ids[row]
            for j in range(len(drafted) + 1):
                history = [*output_ids, *drafted[:j]] if j else output_ids
                at = first_rows[row] + j
                for processor in processors:
                    logits[at] = processor(history, logits[at])
        drafts = [t for d in inputs.draft_token_ids for t in d]
        result = self.rejection_sampler(
            logits,
            torch.tensor(drafts, dtype=torch.int64),  # moved to the device only if it samples
            inputs.num_draft_tokens,
            dataclasses.replace(batch, processors=[]),
        )
        if raw_logprobs is not None:
            # Each scored position's chosen token: the accepted run's, then the placeholder
            # (clamped; those entries are dropped below).
            request_index = torch.tensor([i for i, _ in scored], device=result.token_ids.device)
            position = torch.tensor([j for _, j in scored], device=result.token_ids.device)
            chosen = result.token_ids[request_index, position].clamp(min=0).to(logits.device)
            tensors = logprob_tensors(raw_logprobs, chosen, [wanted[i] for i, _ in scored])
            num_accepted = result.num_accepted

            def finish(output: ModelRunnerOutput) -> None:
                entries = iter(tensors.to_lists())
                accepted = num_accepted.tolist()
                for i in logprob_rows:
                    mine = [next(entries) for _ in range(counts[i])]
                    output.logprobs[requests[i].request_id] = mine[: accepted[i] + 1]

            finishers.append(finish)
        return result.to_lists()

    def _proposal_caps(
        self, inputs: StepInputs, new_tokens: dict[str, list[int]]
    ) -> dict[str, int]:
        """How many drafts each sampling request may get for its next step: up to
        num_speculative_tokens, within its max_tokens and max_model_len (counting this step's
        tokens ``new_tokens``, not appended yet); none for anyone when the batch is larger than
        ``disable_by_batch_size``. Every kind of request speculates: a grammar's drafts are cut by
        the scheduler to what it accepts (each scored position has its own mask), logits
        processors and logprobs run at each scored position (``_verify``)."""
        limit = self.config.speculative.disable_by_batch_size
        requests = inputs.sampling_requests
        if limit is not None and len(inputs.query_starts) > limit:
            return {}
        caps = {}
        for request in requests:
            num_new = len(new_tokens[request.request_id])
            num_tokens = request.num_tokens + num_new
            num_output = request.num_output_tokens + num_new
            cap = min(
                self.num_speculative_tokens,
                request.max_tokens - num_output - 1,
                self.max_model_len - num_tokens - 1,
            )
            if cap > 0:
                caps[request.request_id] = cap
        return caps

    def _apply_grammar_bitmask(
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

    def _sample(
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
            params = request.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(params.seed)
            state = _RequestState(generator, build_logits_processors(request))
            self.requests[request.request_id] = state
        return state

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        n = len(requests)
        params = [r.sampling_params for r in requests]
        all_greedy = all(p.is_greedy for p in params)
        if all_greedy:
            # Greedy rows read none of the per-row settings: no copies for them.
            empty = self.temperature.device[:0]
            batch = SamplingBatch(empty, empty, empty, empty, all_greedy=True)
        else:
            self.temperature.np[:n] = [p.temperature for p in params]
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
            if state.generator is not None:
                batch.generators[row] = state.generator
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
