"""A GGUF file's metadata and tensor table, parsed in one pass over the memory-mapped file.

gguf's ``GGUFReader`` keeps a numpy view of every part of every metadata value, each of a
vocabulary's ~50,000 tokens and merges included: 6 s for the default model on CI's 2-core machine,
paid again by each process that builds its config or tokenizer (a server's front end and its
engine core, every test engine). This reader decodes the values straight to Python objects (the
values ``ReaderField.contents()`` gives) and leaves tensor data as read-only views of the mapping,
in ``GGUFReader``'s layout, for gguf's own ``dequantize``. The format: llama.cpp's docs/gguf.md.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)

# Little-endian struct formats of the scalar value types (GGUF files are little-endian unless a
# converter was asked for big-endian, which this reader refuses).
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALARS = {kind: struct.Struct(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_SCALAR_DTYPES = {kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()}

# The tensor types whose data gguf's reader hands out as elements rather than as raw block bytes.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    #: ggml's dimensions, the fastest-varying first (reversed, they are the torch shape)
    shape: tuple[int, ...]
    #: elements for F16/F32/F64/I*, the raw bytes of each row's blocks for block-quantized types
    data: np.ndarray


class GGUFFile:
    """``metadata``: every key's value as a Python object (str, int, float, bool, lists of them);
    ``tensors``: the tensor table in file order. Raises ValueError for a file that is not GGUF,
    is cut short or is damaged."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        try:
            with open(self.path, "rb") as f:  # mmap refuses an empty file with a ValueError
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, KeyError, ValueError) as e:
            raise ValueError(f"{self.path} is not a readable GGUF file ({e})") from e

    def _parse(self) -> None:
        start = self._take(4)
        if self._map[start : start + 4] != b"GGUF":
            raise ValueError("no GGUF magic at its start")
        version = self._scalar(GGUFValueType.UINT32)
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF; convert it for a little-endian machine")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (supported: {SUPPORTED_VERSIONS})")
        tensor_count = self._scalar(GGUFValueType.UINT64)
        kv_count = self._scalar(GGUFValueType.UINT64)
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"metadata key {key!r} twice")
            self.metadata[key] = self._value(GGUFValueType(self._scalar(GGUFValueType.UINT32)))
        table = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in table]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def _take(self, size: int) -> int:
        """The offset of the next ``size`` bytes, which must lie inside the file."""
        start = self._offset
        if size < 0 or start + size > len(self._map):
            raise ValueError(f"cut short: {size} bytes wanted at offset {start}")
        self._offset = start + size
        return start

    def _scalar(self, kind: GGUFValueType) -> Any:
        scalar = _SCALARS[kind]
        return scalar.unpack_from(self._map, self._take(scalar.size))[0]

    def _string(self) -> str:
        size = self._scalar(GGUFValueType.UINT64)
        start = self._take(size)
        return str(self._map[start : start + size], "utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._scalar(kind)
        item_kind = GGUFValueType(self._scalar(GGUFValueType.UINT32))
        count = self._scalar(GGUFValueType.UINT64)
        if item_kind in _SCALAR_DTYPES:  # numbers in one read
            dtype = _SCALAR_DTYPES[item_kind]
            start = self._take(count * dtype.itemsize)
            return np.frombuffer(self._map, dtype, count, start).tolist()
        return [self._value(item_kind) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar(GGUFValueType.UINT32)
        shape = tuple(self._scalar(GGUFValueType.UINT64) for _ in range(n_dims))
        tensor_type = GGMLQuantizationType(self._scalar(GGUFValueType.UINT32))
        return name, shape, tensor_type, self._scalar(GGUFValueType.UINT64)

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
        offset: int,
    ) -> GGUFTensor:  # fmt: skip
        n_elements = int(np.prod(shape, dtype=np.int64))
        numpy_shape = tuple(reversed(shape))
        if kind in _ELEMENT_DTYPES:
            dtype, count = _ELEMENT_DTYPES[kind], n_elements
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), n_elements // block_size * type_size
            numpy_shape = quant_shape_to_byte_shape(numpy_shape, kind)
        start = data_start + offset
        if start + count * dtype.itemsize > len(self._map):
            raise ValueError(f"tensor {name} ends past the end of the file (cut short)")
        data = np.frombuffer(self._map, dtype, count, start).reshape(numpy_shape)
        return GGUFTensor(name, kind, shape, data)
