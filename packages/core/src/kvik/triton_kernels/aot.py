"""Ahead-of-time compilation of kvik's Triton kernels for GPUs that need not be present.

``triton.compile`` with a ``GPUTarget`` builds for Hopper, Blackwell or MI300X on a machine with
no GPU, so CI catches a kernel that would not build (or would not fit in shared memory) on hardware
it cannot run. The targets are each platform's (``kvik_cuda.aot``, ``kvik_rocm.aot``).
"""

from __future__ import annotations

import re
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
        return check_pdl_variant(kernel, target, **kwargs)
    return compile_kernel(kernel, target, **kwargs)


def first_global_access(ptx: str) -> int:
    """Where the first instruction that reads or writes global memory starts in ``ptx`` (its
    length where there is none)."""
    access = GLOBAL_ACCESS_INSTRUCTION.search(ptx)
    return access.start() if access else len(ptx)
