"""Token embeddings and the LM head (which may share the embedding's weight), split by vocabulary
between tensor-parallel ranks.

Rank r of tp holds the rows ``[r * V', (r + 1) * V')`` of the vocabulary, ``V' = ceil(vocab / tp)``;
the last rank's rows past the vocabulary are padding (zeros). The embedding looks up the tokens in
its rows, zeros for the others, and an all-reduce sums the ranks' lookups (each token is in exactly
one rank's rows). The LM head computes the logits of its rows and an all-gather puts them side by
side, the padding dropped. With one rank both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvik.distributed.parallel_state import get_tp_group
from kvik.model_loader.weight_slice import CheckpointSlice, narrow
from kvik.quantization.unquantized import UnquantizedLinearMethod


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.vocab_size = vocab_size
        self.tp_size = tp.world_size
        rows = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank_in_group * rows
        self.vocab_end = min(self.vocab_start + rows, vocab_size)  # past it: padding
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.weight.weight_loader = self._load_rows

    def _load_rows(
        self, param: Tensor, loaded: Tensor | CheckpointSlice, shard_id: object = None
    ) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"checkpoint shape {tuple(loaded.shape)} != the embedding's "
                f"({self.vocab_size}, {param.shape[1]})"
            )
        own = self.vocab_end - self.vocab_start
        param.data[:own].copy_(narrow(loaded, 0, self.vocab_start, own))
        param.data[own:].zero_()

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, hidden]
        # Tokens outside this rank's rows read row 0 and are zeroed.
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = torch.where(outside, 0, input_ids - self.vocab_start)
        embedded = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0)
        return get_tp_group().all_reduce(embedded)  # [T, hidden]


class LMHead(VocabEmbedding):
    """Hidden states to logits; ``tie(embedding)`` shares the embedding's weight.

    The product runs through an unquantized linear method, as a ``Linear``'s does, so the
    platform's unquantized kernel computes it (the CPU's packed weights); the weight is the
    embedding's layout, so it stays unquantized (as vLLM keeps it for the FP8 formats)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.quant_method = UnquantizedLinearMethod()

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """Logits [N, vocab]; with ``out`` (a buffer of that shape, fp32 or the weight's dtype)
        written there and returned: by the product itself where the kernel can, on one rank."""
        if out is not None:
            if self.tp_size == 1:
                return self.quant_method.apply_into(self, hidden, out)
            return out.copy_(self.forward(hidden))
        logits = self.quant_method.apply(self, hidden)  # [N, vocab / tp]
        if self.tp_size == 1:
            return logits
        return get_tp_group().all_gather(logits, dim=-1)[..., : self.vocab_size]  # [N, vocab]
