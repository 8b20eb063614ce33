"""Token embeddings and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvik.quantization.unquantized import UnquantizedLinearMethod


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)  # [T, hidden]


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

    def forward(self, hidden: Tensor) -> Tensor:
        return self.quant_method.apply(self, hidden)  # [N, vocab]
