"""The whole plugin API of kvik.

A plugin is a module (or object) that implements some of the hooks below, marked with
``kvik.hookimpl``, and is announced through the ``kvik`` entry-point group::

    # pyproject.toml of a vendor package
    [project.entry-points.kvik]
    myaccel = "kvik_myaccel.plugin"

    # kvik_myaccel/plugin.py
    import kvik

    KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION   # the API this plugin was built for

    @kvik.hookimpl
    def kvik_platform():
        from kvik_myaccel.platform import MyAccelPlatform   # cheap: no kernels imported
        return MyAccelPlatform

The built-in packages (``kvik_cpu``, ``kvik_cuda``, ``kvik_rocm``, ``kvik_models``) use exactly
this door. Every ``kvik_register_*`` hook receives a ``register`` callable, and what is registered
is an import path (``"package.module:Attr"``) or a zero-argument factory, so nothing heavy is
imported until it is chosen.

kvik calls the hooks through pluggy, so pluggy's options hold: ``tryfirst``/``trylast`` order the
plugins, ``wrapper=True`` wraps each plugin's call, ``specname`` names the hook. A ``kvik_*``
function is a hook even without the marker (the marker is needed for options only), and a plugin
implementing a hook that is not below (a misspelling) is refused with the hook's name, unless it
is marked ``optionalhook=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvik.platforms.base import Platform

hookspec = pluggy.HookspecMarker("kvik")
hookimpl = pluggy.HookimplMarker("kvik")

#: Registration target: "package.module:Attribute" or a zero-argument callable returning it.
Target = str | Callable[[], Any]


@hookspec
def kvik_platform() -> type[Platform] | None:
    """Return this package's ``Platform`` subclass.

    Return the class, always (also when the hardware is absent): kvik decides with the class's
    ``is_present()``, which must be cheap, import no kernels and create no device context.
    """


@hookspec
def kvik_register_attention_backends(register: Callable[[str, Target], None]) -> None:
    """Register attention backends, e.g.
    ``register("TRITON_ATTN", "kvik.triton_kernels.attention:TritonAttentionBackend")``.

    The target resolves to a ``kvik.attention.backend.AttentionBackend`` subclass. A platform lists
    backend names in its order of preference; the first registered one that supports the model's
    dtype and head size is chosen.
    """


@hookspec
def kvik_register_quantization_methods(register: Callable[[str, Target], None]) -> None:
    """Register quantization methods: ``register("fp8", "kvik.quantization.fp8:Fp8Config")``.

    The target resolves to the method's config class, a ``kvik.quantization.QuantizationConfig``
    subclass (built from a checkpoint's ``quantization_config`` or from ``--quantization NAME``; it
    gives each linear layer its ``LinearMethod``); it is imported only when a model asks for that
    method, or ``kvik env`` asks which platforms run it. Core registers its own methods through
    this hook too (its entry point ``quantization``).
    """


@hookspec
def kvik_register_models(register: Callable[[str, Target], None]) -> None:
    """Register model architectures, e.g.
    ``register("LlamaForCausalLM", "kvik_models.llama:LlamaForCausalLM")``.

    The name is the architecture string of a Hugging Face ``config.json``; the target resolves to an
    ``nn.Module`` class built as ``cls(config)`` (see ``kvik.models.registry``).
    """


@hookspec
def kvik_register_commands(register: Callable[[str, str, str], None]) -> None:
    """Register ``kvik`` subcommands: ``register("serve", "kvik_server.cli", "run the server")``.

    The module path names a module with ``add_arguments(parser)`` and ``run(args) -> int``; it is
    imported only when its subcommand runs. This is how the server package adds ``kvik serve``
    without core importing it.
    """
