"""Ahead-of-time compilation of kvik's Triton kernels for GPUs that need not be present.

``triton.compile`` with a ``GPUTarget`` builds for Hopper, Blackwell or MI300X on a machine with
no GPU, so CI catches a kernel that would not build (or would not fit in shared memory) on hardware
it cannot run. The targets are each platform's (``kvik_cuda.aot``, ``kvik_rocm.aot``).
"""

from __future__ import annotations

import re
import struct
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_kernel(
    kernel: Any,
    target: GPUTarget,
    types: dict[str, str],
    constexprs: dict[str, Any],
    num_warps: int,
    num_stages: int = 1,
    aligned: tuple[str, ...] = (),
    launch_pdl: bool = False,
) -> Any:
    """Compile ``kernel`` for ``target``. ``types`` maps each run-time argument to a Triton type
    ("*bf16", "i32", "fp32"); ``constexprs`` gives every constexpr argument its value, or takes
    the kernel's default for it (as a launch does).

    ``aligned`` names the run-time arguments known to be multiples of 16 (pointers, strides), as
    Triton's JIT finds them at a launch and specializes for: without that, loads are not
    vectorized, nor pipelined through shared memory in ``num_stages`` stages. Those the kernel
    keeps generic (``do_not_specialize``, ``do_not_specialize_on_alignment``) stay generic here
    too, as at a launch. ``launch_pdl``: the kernel is launched with programmatic dependent
    launch (kvik.triton_kernels.pdl)."""
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}
    signature = {
        name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names
    }
    generic = {
        p.name for p in kernel.params if p.do_not_specialize or p.do_not_specialize_on_alignment
    }
    attrs = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name in aligned
        if name not in generic
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if launch_pdl:
        options["launch_pdl"] = True
    return triton.compile(source, target=target, options=options)


#: PTX instructions that read or write global memory.
GLOBAL_ACCESSES = ("ld.global", "st.global", "cp.async", "atom.", "red.", "cp.reduce")
#: Their mnemonics where an instruction starts (after white space, as after a tab or a predicate
#: such as ``@%p3``): "red." inside ``ld.shared.b32`` is no reduction (sm_100's kernels read
#: their tensor-memory address from shared memory before the wait).
GLOBAL_ACCESS_INSTRUCTION = re.compile(
    r"(?<=\s)(?:" + "|".join(map(re.escape, GLOBAL_ACCESSES)) + ")"
)


def check_pdl_variant(kernel: Any, target: GPUTarget, constexprs: dict[str, Any], **kwargs) -> Any:
    """Compile the variant of ``kernel`` that an sm_90+ launch takes (kvik.triton_kernels.pdl:
    ``PDL`` True, launched with PDL) and check its PTX: the wait for the kernel ahead comes
    before any global load or store, and the release of its dependents after the wait."""
    compiled = compile_kernel(
        kernel, target, constexprs={**constexprs, "PDL": True}, launch_pdl=True, **kwargs
    )
    ptx = compiled.asm["ptx"]
    name = kernel.__name__
    assert compiled.metadata.launch_pdl, name
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("griddepcontrol.launch_dependents"), name
    assert wait < first_global_access(ptx), f"{name}: a global access before griddepcontrol.wait"
    return compiled


def compile_as_launched(kernel: Any, target: GPUTarget, **kwargs) -> Any:
    """``kernel`` compiled for ``target`` in the variant a launch there takes: where it takes
    ``PDL`` and the target is NVIDIA from sm_90 (``kvik.triton_kernels.pdl.uses_pdl``), with
    PDL and its wait checked (``check_pdl_variant``); else as ``compile_kernel`` builds it. The
    variant without PDL is the same code less the wait: AMD's and the interpreter's."""
    if target.backend == "cuda" and target.arch >= 90 and "PDL" in kernel.arg_names:
        compiled = check_pdl_variant(kernel, target, **kwargs)
    else:
        compiled = compile_kernel(kernel, target, **kwargs)
    if target.backend == "cuda":
        check_register_allocation(compiled, kernel.__name__)
    return compiled


#: The cubin's per-kernel attributes (``.nv.info``): EIATTR_REGCOUNT and EIATTR_FRAME_SIZE, each
#: a 4-byte symbol index and a 4-byte value.
EIATTR_REGCOUNT, EIATTR_FRAME_SIZE = 0x2F, 0x11
#: ptxas's fallback that ``check_register_allocation`` refuses: 32 registers a thread and at least
#: this much stack. fp32 attention variants fell into it on sm_90 (32 registers, 5-13 KB of stack a
#: thread) and ran 5-15x slower than their neighbours in 255 registers (docs/benchmarks.md, "fp32
#: attention on Hopper"); the GPU's figures for each variant matched these compile-time ones.
SPILL_MODE_REGISTERS, SPILL_MODE_FRAME_BYTES = 32, 1024


def cubin_registers_and_frame(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack frame bytes a thread) of the one kernel in ``cubin`` (an ELF
    file), as ptxas allocated them: what ``ptxas -v`` prints and the driver reports once loaded."""
    section_offset = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size)
        for i in range(count)
    ]
    names_at = headers[names_index][4]

    def name(header) -> bytes:
        start = names_at + header[0]
        return cubin[start : cubin.index(b"\0", start)]

    (info,) = [h for h in headers if name(h) == b".nv.info"]
    data = cubin[info[4] : info[4] + info[5]]
    values: dict[int, int] = {}
    at = 0
    while at < len(data):
        form, attribute = data[at], data[at + 1]
        if form == 0x04:  # EIFMT_SVAL: a 2-byte size, then that many bytes
            (size,) = struct.unpack_from("<H", data, at + 2)
            if attribute in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and size == 8:
                values[attribute] = struct.unpack_from("<I", data, at + 8)[0]
            at += 4 + size
        else:  # EIFMT_NVAL, _BVAL, _HVAL: 4 bytes in all
            at += 4
    return values[EIATTR_REGCOUNT], values.get(EIATTR_FRAME_SIZE, 0)


def check_register_allocation(compiled: Any, name: str) -> None:
    """``compiled`` (an NVIDIA target's) is not in ptxas's 32-register fallback."""
    registers, frame = cubin_registers_and_frame(compiled.asm["cubin"])
    assert not (registers <= SPILL_MODE_REGISTERS and frame >= SPILL_MODE_FRAME_BYTES), (
        f"{name}: ptxas gave it {registers} registers and {frame} bytes of stack a thread "
        f"(its 32-register fallback, several times slower): choose another tile or warp count"
    )


def first_global_access(ptx: str) -> int:
    """Where the first instruction that reads or writes global memory starts in ``ptx`` (its
    length where there is none)."""
    access = GLOBAL_ACCESS_INSTRUCTION.search(ptx)
    return access.start() if access else len(ptx)
