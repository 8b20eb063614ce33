"""A draft model: a second, smaller model sharing the target's tokenizer proposes k tokens greedily.

The draft has its own KV cache tensors laid out in the target's blocks: a request's block table
serves both, so the draft needs no allocator of its own. It keeps its cache in step by running
every target step's inputs too (prompt chunks, decodes, verifications: the same ids, positions and
slots); rejected drafts' slots are overwritten later, as the target's are. After a step, for each
request that may speculate, it runs k one-token steps from the request's newest token, writing its
cache at the positions after it (the scheduler allocates those ``num_lookahead_tokens`` slots).
The draft always runs eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvik import ops
from kvik.attention.backend import AttentionMetadata
from kvik.attention.selector import attach_attention
from kvik.layers.attention import Attention
from kvik.layers.sampler import greedy_ids
from kvik.model_loader.loader import load_model, load_model_config
from kvik.spec_decode.proposer import Proposer
from kvik.worker.forward_context import ForwardContext, forward_context

if TYPE_CHECKING:
    from kvik.worker.model_runner import ModelRunner


class DraftModelProposer(Proposer):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        config = runner.config
        target = config.model
        self.k = config.speculative.num_speculative_tokens
        self.model_config = load_model_config(
            config.speculative.model,
            dtype=target.dtype,
            max_model_len=target.max_model_len,
            seed=target.seed,
        )
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {config.speculative.model!r} has a vocabulary of "
                f"{self.model_config.vocab_size} tokens, the target {target.vocab_size}: a draft "
                "model must share the target's tokenizer"
            )
        with ops.ops_dispatch(config.ops_dispatch):
            self.model = load_model(self.model_config, runner.device, runner.platform)
            self._argmax_rows = ops.small_op("argmax_rows")
        self.layers: dict[str, Attention] = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        # The draft's cache holds the model's dtype (no FP8 scales of its own).
        self.cache_dtype = runner.dtype
        self.backend, self.builder = attach_attention(runner, self.layers.values())
        self.max_blocks = -(-runner.max_model_len // runner.block_size)

    def kv_cache_bytes_per_block(self) -> int:
        per_block = sum(
            2 * self.runner.block_size * layer.num_kv_heads * layer.head_size
            for layer in self.layers.values()
        )
        return per_block * self.cache_dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for layer in self.layers.values():
            if num_blocks == 0:
                layer.kv_cache = None
                continue
            shape = self.backend.kv_cache_shape(
                num_blocks, self.runner.block_size, layer.num_kv_heads, layer.head_size
            )
            platform, device = self.runner.platform, self.runner.device
            layer.kv_cache = platform.zeroed_kv_cache(shape, self.cache_dtype, device)

    def _forward(self, input_ids, positions, common: AttentionMetadata) -> torch.Tensor:
        context = ForwardContext(self.builder.build(common), self.layers)
        with forward_context(context):
            return self.model(input_ids, positions)

    def propose(self, scheduler_output, inputs, new_tokens, caps, launched=None):
        # The target's step, through the draft: its cache then holds every computed position.
        self._forward(inputs.input_ids, inputs.positions, inputs.common_metadata)
        block_ids = {s.request.request_id: s.block_ids for s in scheduler_output.scheduled}
        requests = [r for r in inputs.sampling_requests if caps.get(r.request_id)]
        if not requests:
            return {}
        ids = [r.request_id for r in requests]
        count = len(requests)
        bs = self.runner.block_size
        table = np.zeros((count, self.max_blocks), dtype=np.int32)
        num_blocks = np.empty(count, dtype=np.int64)
        for i, request_id in enumerate(ids):
            blocks = block_ids[request_id]
            table[i, : len(blocks)] = blocks
            num_blocks[i] = len(blocks)
        # The newest token of each request, at the position after its known tokens.
        last = [new_tokens[rid][-1] for rid in ids]
        first_position = np.array(
            [r.num_tokens + len(new_tokens[r.request_id]) - 1 for r in requests], dtype=np.int64
        )
        num_steps = max(caps[rid] for rid in ids)
        device = self.runner.device
        rows = np.arange(count)
        block_table = torch.from_numpy(table).to(device)
        query_start_loc = torch.arange(count + 1, dtype=torch.int32, device=device)
        query_lens = torch.ones(count, dtype=torch.int32, device=device)
        token_ids = torch.tensor(last, dtype=torch.int64, device=device)
        drafted = []
        for step in range(num_steps):
            positions = first_position + step
            block = positions // bs
            # A slot past the request's blocks (none allocated there) is not written.
            inside = block < num_blocks
            slots = np.where(
                inside, table[rows, np.minimum(block, num_blocks - 1)] * bs + positions % bs, -1
            )
            common = AttentionMetadata(
                num_actual_tokens=count,
                num_reqs=count,
                query_start_loc=query_start_loc,
                query_lens=query_lens,
                seq_lens=torch.from_numpy((positions + 1).astype(np.int32)).to(device),
                block_table=block_table,
                slot_mapping=torch.from_numpy(slots).to(device),
                max_query_len=1,
                max_seq_len=int(positions.max()) + 1,
                block_size=bs,
            )
            hidden = self._forward(token_ids, torch.from_numpy(positions).to(device), common)
            token_ids = greedy_ids(self._argmax_rows, self.model.compute_logits(hidden))
            drafted.append(token_ids)
        proposals = torch.stack(drafted, dim=1).tolist()
        return {rid: proposals[i][: caps[rid]] for i, rid in enumerate(ids)}
