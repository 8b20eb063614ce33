"""The device-neutral model runner: one forward pass per step over every scheduled request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from kvik import ops
from kvik.attention.backend import AttentionBackend, AttentionMetadata
from kvik.attention.selector import select_attention_backend
from kvik.layers.attention import Attention
from kvik.layers.logits_processors import LogitsProcessor, build_logits_processors
from kvik.layers.sampler import Sampler, SamplingBatch, gather_logprobs
from kvik.model_loader.loader import load_model
from kvik.scheduler.output import TokenLogprobs
from kvik.worker.forward_context import ForwardContext, forward_context

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.platforms.base import Platform
    from kvik.request import Request
    from kvik.scheduler.output import SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Complete prompt logprobs of requests whose prompt finished computing in this step.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class PendingStep:
    """A launched step; ``collect()`` returns its output (once the device is done)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def collect(self) -> ModelRunnerOutput:
        return self._output


@dataclass
class StepInputs:
    input_ids: Tensor  # [T]
    positions: Tensor  # [T]
    attn_metadata: object  # the backend's metadata
    logits_indices: Tensor  # [N] rows of the hidden states that sample
    query_starts: list[int]  # [R] first row of each scheduled request
    sampling_requests: list[Request]  # the N requests that sample, in row order


@dataclass
class _RequestState:
    """What the runner keeps per request across steps."""

    generator: torch.Generator | None
    processors: list[LogitsProcessor]
    # Prompt logprobs by position, gathered chunk by chunk (a recompute after preemption overwrites).
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


class ModelRunner:
    def __init__(self, config: EngineConfig, platform: type[Platform]) -> None:
        self.config = config
        self.platform = platform
        self.device = platform.device()
        self.block_size = config.cache.block_size
        model_config = config.model
        self.dtype = model_config.dtype
        ops.use_native_ops(platform.native_ops)  # before the layers are built
        self.model: nn.Module = load_model(model_config, self.device)
        platform.prepare_model(self.model, config)
        self.attention_layers: dict[str, Attention] = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        first = next(iter(self.attention_layers.values()))
        self.backend: type[AttentionBackend] = select_attention_backend(
            platform, self.dtype, first.head_size, self.block_size
        )
        for layer in self.attention_layers.values():
            layer.impl = self.backend.impl_class()(
                layer.num_heads,
                layer.head_size,
                layer.scale,
                layer.num_kv_heads,
                layer.sliding_window,
            )
        generator = torch.Generator(self.device).manual_seed(model_config.seed)
        self.sampler = Sampler(generator)
        self.eos_token_ids = sorted(model_config.eos_token_ids())
        self.requests: dict[str, _RequestState] = {}

    # --- KV cache -------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        per_layer = sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_size
            for layer in self.attention_layers.values()
        )
        return per_layer * self.dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for layer in self.attention_layers.values():
            shape = self.backend.kv_cache_shape(
                num_blocks, self.block_size, layer.num_kv_heads, layer.head_size
            )
            # Zeros, not empty: masked-out slots still meet a zero attention weight, and 0 * NaN
            # from uninitialised memory would poison the sum.
            layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

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
        self.initialize_kv_cache(next_block)
        rng_state = self.sampler.generator.get_state()  # the dummy step must not move the RNG
        try:
            self.execute_model(SchedulerOutput(scheduled, num_tokens))
        finally:
            self.sampler.generator.set_state(rng_state)
            for s in scheduled:
                self.requests.pop(s.request.request_id, None)
            for layer in self.attention_layers.values():
                layer.kv_cache = None

    # --- one step -------------------------------------------------------------------------
    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        scheduled = scheduler_output.scheduled
        token_ids: list[int] = []
        for s in scheduled:
            token_ids.extend(s.request.all_token_ids[s.start : s.start + s.num_tokens])
        num_reqs = len(scheduled)
        query_lens = torch.tensor([s.num_tokens for s in scheduled], dtype=torch.int32)
        starts = torch.tensor([s.start for s in scheduled], dtype=torch.int32)
        query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        num_tokens = len(token_ids)
        if num_tokens == num_reqs:  # one token per request (decodes): no expansion to build
            req_index = torch.arange(num_reqs)
            positions = starts.long()
        else:
            req_index = torch.repeat_interleave(torch.arange(num_reqs), query_lens)  # [T]
            offsets = torch.arange(num_tokens) - query_start_loc[:-1].long()[req_index]
            positions = starts.long()[req_index] + offsets  # [T]
        max_blocks = max(len(s.block_ids) for s in scheduled)
        # One tensor from padded lists: a small tensor per row cost more than the rows' contents.
        block_table = torch.tensor(
            [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in scheduled],
            dtype=torch.int32,
        )
        bs = self.block_size
        slot_mapping = block_table.long()[req_index, positions // bs] * bs + positions % bs
        seq_lens = starts + query_lens
        sample_rows = [row for row, s in enumerate(scheduled) if s.samples]
        common = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            query_start_loc=query_start_loc,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
        )
        metadata = self.backend.build_metadata(self._to_device(common))
        return StepInputs(
            input_ids=self._h2d(torch.tensor(token_ids, dtype=torch.long)),
            positions=self._h2d(positions),
            attn_metadata=metadata,
            logits_indices=self._h2d((query_start_loc[1:].long() - 1)[sample_rows]),
            query_starts=query_start_loc[:-1].tolist(),
            sampling_requests=[scheduled[row].request for row in sample_rows],
        )

    def _h2d(self, tensor: Tensor) -> Tensor:
        """A step input built on the host, on the device: staged through pinned memory and copied
        without blocking the host (a pageable source would make the copy wait)."""
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _to_device(self, common: AttentionMetadata) -> AttentionMetadata:
        if self.device.type == "cpu":
            return common
        for name, value in vars(common).items():
            if isinstance(value, Tensor):
                setattr(common, name, self._h2d(value))
        return common

    @torch.inference_mode()
    def forward_hidden(self, inputs: StepInputs) -> Tensor:
        """Run the model over the step's tokens: hidden states [T, hidden]."""
        context = ForwardContext(inputs.attn_metadata, self.attention_layers)
        with forward_context(context):
            return self.model(inputs.input_ids, inputs.positions)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, synchronously: ``launch`` then ``collect``."""
        return self.launch(scheduler_output).collect()

    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Start a step on the device and return at once; ``PendingStep.collect()`` waits for its
        sampled tokens. Tokens of the step that are not known yet (a request's last output token,
        still in flight from the previous step under asynchronous scheduling: positions at or past
        ``len(request.all_token_ids)``) are taken from the previous step's sampled tokens on the
        device."""
        return PendingStep(self._execute(scheduler_output))

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        inputs = self.prepare_inputs(scheduler_output)
        hidden = self.forward_hidden(inputs)
        output = ModelRunnerOutput()
        self._prompt_logprobs(scheduler_output, inputs, hidden, output)
        requests = inputs.sampling_requests
        if not requests:
            return output
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        wanted = [r.sampling_params.logprobs for r in requests]
        # Logprobs come from the raw logits, before processors and temperature (vLLM's default).
        raw_logprobs = logits.log_softmax(-1) if any(w is not None for w in wanted) else None
        sampled = self.sampler(logits, self._sampling_batch(requests))
        for request, token in zip(requests, sampled.tolist()):
            output.sampled_token_ids[request.request_id] = [token]
        if raw_logprobs is not None:
            rows = [i for i, w in enumerate(wanted) if w is not None]
            entries = gather_logprobs(raw_logprobs[rows], sampled[rows], [wanted[i] for i in rows])
            for row, entry in zip(rows, entries):
                output.logprobs[requests[row].request_id] = [entry]
        return output

    def _prompt_logprobs(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        hidden: Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Logprobs of each prompt token given the ones before it, for requests that ask."""
        for s, first_row in zip(scheduler_output.scheduled, inputs.query_starts):
            request = s.request
            num_top = request.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            state = self._state(request)
            prompt_len = request.num_prompt_tokens
            # Position p predicts prompt token p + 1; the last prompt position predicts output.
            end = min(s.start + s.num_tokens, prompt_len - 1)
            if end > s.start:
                rows = torch.arange(first_row, first_row + end - s.start, device=hidden.device)
                targets = torch.tensor(
                    request.prompt_token_ids[s.start + 1 : end + 1], device=hidden.device
                )
                logprobs = self.model.compute_logits(hidden[rows]).float().log_softmax(-1)
                entries = gather_logprobs(logprobs, targets, [num_top] * len(targets))
                for offset, entry in enumerate(entries):
                    state.prompt_logprobs[s.start + offset] = entry
            if s.start + s.num_tokens >= prompt_len and not state.prompt_logprobs_sent:
                state.prompt_logprobs_sent = True
                output.prompt_logprobs[request.request_id] = [
                    state.prompt_logprobs[p] for p in range(prompt_len - 1)
                ]

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
        params = [r.sampling_params for r in requests]
        batch = SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            all_greedy=all(p.is_greedy for p in params),
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
        for name in ("temperature", "top_k", "top_p", "min_p"):
            setattr(batch, name, self._h2d(getattr(batch, name)))
        return batch
