"""Checkpoint tensors that are read only where a rank needs them.

Under tensor parallelism each rank holds a part of most weights. The safetensors loader then hands
the model ``CheckpointSlice``s instead of tensors: a slice knows its name, shape and dtype and reads
from the file only the rows (or columns) a weight loader narrows it to, so no rank ever builds a
full tensor it would cut down. Loaders go through ``narrow`` and ``materialize``, which take plain
tensors too (a single rank, GGUF, tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: safetensors' dtype names -> torch dtypes (those checkpoints of the supported formats use).
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointSlice:
    """A tensor of an open safetensors file, not read yet (``safe_open(...).get_slice(name)``).

    The file must stay open while the slice is used: the loader yields slices from inside its
    ``safe_open`` block, and loaders consume each before asking for the next."""

    def __init__(self, name: str, file) -> None:
        self.name = name
        self._file = file  # safetensors' safe_open handle
        handle = file.get_slice(name)
        self._handle = handle
        self.shape = torch.Size(handle.get_shape())
        dtype = handle.get_dtype()
        if dtype not in _DTYPES:
            raise ValueError(
                f"checkpoint tensor {name!r} has dtype {dtype}, which kvik cannot read"
            )
        self.dtype = _DTYPES[dtype]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        """Only ``[start, start + length)`` of dim ``dim`` read from the file."""
        index = [slice(None)] * self.dim()
        index[dim] = slice(start, start + length)
        return self._handle[tuple(index)]

    def materialize(self) -> Tensor:
        return self._file.get_tensor(self.name)

    def __repr__(self) -> str:
        return f"CheckpointSlice({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def narrow(loaded: Tensor | CheckpointSlice, dim: int, start: int, length: int) -> Tensor:
    """``loaded.narrow(dim, start, length)``, reading only that part where it is a slice; an
    error that names the numbers where the tensor is too small for it."""
    if start < 0 or start + length > loaded.shape[dim]:
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} has no [{start}, {start + length}) "
            f"along dim {dim}"
        )
    return loaded.narrow(dim, start, length)


def materialize(loaded: Tensor | CheckpointSlice) -> Tensor:
    """The whole tensor (read from the file where ``loaded`` is a slice)."""
    return loaded.materialize() if isinstance(loaded, CheckpointSlice) else loaded
