"""kvik.op_library: ops defined on a torch.library.Library behave as torch.library.custom_op's did
(schema with mutations, fake implementations under torch.compile, per-device kernels a platform
registers) and kvik's own ops are defined that way."""

from __future__ import annotations

import torch
from torch import Tensor

import kvik.distributed.parallel_state  # noqa: F401  (defines kvik::all_reduce)
import kvik.ops
import kvik.quantization.ops  # noqa: F401  (defines the FP8 products)
from kvik.op_library import KvikOp, custom_op


def _scale_into(x: Tensor, factor: float, out: Tensor) -> None:
    out.copy_(x * factor)


def _plus_one(x: Tensor) -> Tensor:
    return x + 1


scale_into = custom_op("kvik_test_ops::scale_into", _scale_into, mutates_args=("out",))
plus_one = custom_op("kvik_test_ops::plus_one", mutates_args=())(_plus_one)


@scale_into.register_fake
def _(x, factor, out) -> None:
    return None


@plus_one.register_fake
def _(x) -> Tensor:
    return torch.empty_like(x)


def test_schema_marks_the_mutated_argument():
    schema = torch.ops.kvik_test_ops.scale_into.default._schema
    mutated = [
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]
    assert mutated == ["out"]
    assert not [
        a for a in torch.ops.kvik_test_ops.plus_one.default._schema.arguments if a.alias_info
    ]


def test_calls_dispatch_to_the_reference():
    x = torch.randn(3, 5)
    out = torch.empty_like(x)
    scale_into(x, 2.5, out)
    torch.testing.assert_close(out, x * 2.5)
    torch.testing.assert_close(plus_one(x), x + 1)
    torch.testing.assert_close(torch.ops.kvik_test_ops.plus_one(x), x + 1)


def test_compiled_with_dynamic_shapes_matches_eager():
    def model(x: Tensor) -> Tensor:
        y = plus_one(x) * 3
        out = torch.empty_like(y)
        scale_into(y, 0.5, out)
        return out - 1

    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for rows in (4, 7, 9):
        x = torch.randn(rows, 6)
        torch.testing.assert_close(compiled(x), model(x))


def test_a_kernel_registered_for_the_device_replaces_the_reference():
    def doubled(x: Tensor) -> Tensor:
        return 2 * x

    custom_op("kvik_test_ops::twice_or_plus_one", _plus_one, mutates_args=())
    x = torch.ones(4)
    torch.testing.assert_close(torch.ops.kvik_test_ops.twice_or_plus_one(x), x + 1)
    torch.library.register_kernel("kvik_test_ops::twice_or_plus_one", "cpu", doubled)
    torch.testing.assert_close(torch.ops.kvik_test_ops.twice_or_plus_one(x), 2 * x)


def test_kvik_ops_are_defined_without_custom_op_wrappers():
    # torch.library.custom_op's CustomOpDef wraps every call in Python layers (tens of µs); the
    # attention op runs once a layer in a PIECEWISE step, so none of kvik's ops may be one.
    for module in (kvik.ops, kvik.quantization.ops, kvik.distributed.parallel_state):
        for value in vars(module).values():
            assert not isinstance(value, torch._library.custom_ops.CustomOpDef), value
    assert isinstance(kvik.ops.unified_attention_with_rotary, KvikOp)
