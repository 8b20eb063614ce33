"""Tensor-parallel layers as one rank builds and loads them: which part of each checkpoint tensor
a rank keeps (weights, biases, FP8 scales, the vocabulary), and the shapes it refuses.

Building and loading need no collectives, so a rank is played here by setting this process's
tensor-parallel group to a place in a group of two; the forward passes with real ranks are in
tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvik.distributed import parallel_state
from kvik.distributed.parallel_state import GroupCoordinator
from kvik.layers.embedding import LMHead, VocabEmbedding
from kvik.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
    heads_per_rank,
)
from kvik.model_loader.weight_slice import CheckpointSlice
from kvik.quantization.base import QuantizationConfig
from kvik.quantization.fp8 import Fp8Config
from kvik.quantization.fp8_methods import Fp8ScaledLinearMethod


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(rank, size): this process is ``rank`` of a tensor-parallel group of ``size``."""

    def place(rank: int, size: int = 2) -> None:
        group = GroupCoordinator(list(range(size)), rank, device_group=None)
        monkeypatch.setattr(parallel_state, "_TP", group)

    return place


def load(layer, name: str, tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def block_fp8() -> Fp8Config:
    return Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    )


class ChannelFp8(QuantizationConfig):
    """FP8 weights with one scale per output channel, on every layer."""

    name = "test-channel-fp8"

    def quantized_method(self, layer, prefix, names):
        return Fp8ScaledLinearMethod("channel", static_input=False)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_parallel_keeps_its_rows(as_rank, rank):
    as_rank(rank)
    full_w, full_b = torch.randn(8, 3), torch.randn(8)
    layer = ColumnParallelLinear(3, 8, bias=True)
    load(layer, "weight", full_w)
    load(layer, "bias", full_b)
    rows = slice(4 * rank, 4 * rank + 4)
    assert torch.equal(layer.weight, full_w[rows]) and torch.equal(layer.bias, full_b[rows])


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_keeps_its_columns_and_rank_0_the_bias(as_rank, rank):
    as_rank(rank)
    full_w, full_b = torch.randn(3, 8), torch.randn(3)
    layer = RowParallelLinear(8, 3, bias=True)
    load(layer, "weight", full_w)
    load(layer, "bias", full_b)
    assert torch.equal(layer.weight, full_w[:, 4 * rank : 4 * rank + 4])
    # The ranks' partial products are summed: the bias must be in one of them only.
    assert torch.equal(layer.bias, full_b if rank == 0 else torch.zeros(3))


def test_a_rank_refuses_a_checkpoint_tensor_of_another_size(as_rank):
    """Rank 0 of a layer of 8 columns read its 4 from a tensor of 12 (and rank 1 the next 4),
    the rest unread: a checkpoint larger than the config loaded, wrong, on every rank."""
    as_rank(0)
    with pytest.raises(ValueError, match=r"shape \(3, 12\) has 12 along dim 1, where down takes 8"):
        load(RowParallelLinear(8, 3, prefix="down"), "weight", torch.randn(3, 12))
    with pytest.raises(ValueError, match=r"has 4 along dim 0, where qkv takes 2"):
        qkv = QKVLinear(5, 2, num_heads=4, num_kv_heads=1, prefix="qkv")
        load(qkv, "weight", torch.randn(4, 5), "k")


def test_merged_column_splits_each_projection(as_rank):
    as_rank(1)
    gate, up = torch.randn(6, 2), torch.randn(6, 2)
    layer = MergedColumnLinear(2, [6, 6])
    load(layer, "weight", gate, 0)
    load(layer, "weight", up, 1)
    assert torch.equal(layer.weight, torch.cat([gate[3:], up[3:]]))


def test_qkv_splits_heads_and_replicates_a_kv_head(as_rank):
    """Four query heads, one KV head, four ranks: rank 2 holds query head 2 and the KV head."""
    as_rank(2, size=4)
    d = 2
    q, k, v = torch.randn(4 * d, 5), torch.randn(d, 5), torch.randn(d, 5)
    layer = QKVLinear(5, d, num_heads=4, num_kv_heads=1)
    assert (layer.num_heads, layer.num_kv_heads) == (1, 1)
    for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
        load(layer, "weight", tensor, shard_id)
    assert torch.equal(layer.weight, torch.cat([q[2 * d : 3 * d], k, v]))


def test_qkv_splits_kv_heads_when_there_are_enough(as_rank):
    as_rank(1)
    d = 2
    layer = QKVLinear(5, d, num_heads=4, num_kv_heads=2)
    k = torch.randn(2 * d, 5)
    load(layer, "weight", torch.randn(4 * d, 5), "q")
    load(layer, "weight", k, "k")
    assert torch.equal(layer.weight[2 * d : 3 * d], k[d:])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "expected"),
    [(4, 2, 2, (2, 1)), (8, 8, 4, (2, 2)), (4, 1, 2, (2, 1)), (8, 2, 8, (1, 1))],
)
def test_heads_per_rank(heads, kv_heads, tp, expected):
    assert heads_per_rank(heads, kv_heads, tp) == expected


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (3, 1, 2, "3 attention heads do not split between 2 tensor-parallel ranks"),
        (6, 3, 2, "3 KV heads do not split between 2 tensor-parallel ranks"),
        (6, 2, 3, "2 KV heads cannot be replicated evenly over 3 tensor-parallel ranks"),
    ],
)
def test_heads_that_do_not_split_are_named(heads, kv_heads, tp, message):
    with pytest.raises(ValueError, match=message):
        heads_per_rank(heads, kv_heads, tp)


def test_features_that_do_not_split_are_named(as_rank):
    as_rank(0, size=3)
    with pytest.raises(ValueError, match="down_proj: input features: 8 do not split between 3"):
        RowParallelLinear(8, 4, prefix="model.layers.0.mlp.down_proj")


def test_a_replicated_linear_loads_whole(as_rank):
    as_rank(1)
    full = torch.randn(4, 3)
    layer = Linear(3, 4)
    load(layer, "weight", full)
    assert torch.equal(layer.weight, full)


@pytest.mark.parametrize("rank", [0, 1])
def test_block_fp8_scales_shard_with_their_weights(as_rank, rank):
    as_rank(rank)
    weight = torch.randn(512, 256).to(torch.float8_e4m3fn)
    scales = torch.rand(4, 2)
    column = ColumnParallelLinear(256, 512, quant_config=block_fp8(), prefix="up")
    load(column, "weight", weight)
    load(column, "weight_scale_inv", scales)
    assert column.weight.view(torch.uint8).equal(
        weight[256 * rank : 256 * (rank + 1)].view(torch.uint8)
    )
    assert torch.equal(column.weight_scale_inv, scales[2 * rank : 2 * rank + 2])

    row = RowParallelLinear(512, 256, quant_config=block_fp8(), prefix="down")
    load(row, "weight", weight.T.contiguous())
    load(row, "weight_scale_inv", scales.T.contiguous())
    assert torch.equal(row.weight_scale_inv, scales.T[:, 2 * rank : 2 * rank + 2])


def test_a_block_that_does_not_divide_a_rank_part_is_refused(as_rank):
    as_rank(0)
    with pytest.raises(ValueError, match="192 output rows, not a multiple of the FP8 weight block"):
        ColumnParallelLinear(256, 384, quant_config=block_fp8(), prefix="model.layers.0.up")
    with pytest.raises(
        ValueError, match="64 input columns, not a multiple of the FP8 weight block"
    ):
        RowParallelLinear(128, 256, quant_config=block_fp8(), prefix="model.layers.0.down")


def test_per_channel_scales_follow_the_rows(as_rank):
    as_rank(1)
    scales = torch.rand(8, 1)
    column = ColumnParallelLinear(4, 8, quant_config=ChannelFp8())
    load(column, "weight_scale", scales)
    assert torch.equal(column.weight_scale, scales[4:, 0])
    row = RowParallelLinear(8, 8, quant_config=ChannelFp8())
    load(row, "weight_scale", scales)  # a row-parallel layer keeps every output channel
    assert torch.equal(row.weight_scale, scales[:, 0])


@pytest.mark.parametrize("rank", [0, 1])
def test_vocabulary_rows_and_padding(as_rank, rank):
    as_rank(rank)
    full = torch.randn(5, 2)
    embedding = VocabEmbedding(5, 2)
    load(embedding, "weight", full)
    if rank == 0:
        assert torch.equal(embedding.weight, full[:3])
    else:  # rows 3, 4 and a padding row
        assert torch.equal(embedding.weight, torch.cat([full[3:], torch.zeros(1, 2)]))
    head = LMHead(5, 2)
    head.tie(embedding)
    assert head.weight is embedding.weight


def test_a_rank_reads_only_its_part_of_a_checkpoint_tensor(tmp_path, as_rank):
    as_rank(1)
    weight = torch.randn(8, 3)
    save_file({"w": weight}, tmp_path / "model.safetensors")
    layer = ColumnParallelLinear(3, 8)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        part = CheckpointSlice("w", f)
        assert (part.shape, part.dtype) == (torch.Size([8, 3]), torch.float32)
        assert torch.equal(part.narrow(0, 4, 4), weight[4:])
        load(layer, "weight", part)
    assert torch.equal(layer.weight, weight[4:])
