"""How to add a hardware platform to kvik from your own package.

This package is a complete platform plugin that depends on nothing but kvik (and torch). It
implements the plain ``kvik.platforms.Platform`` contract and its own attention backend, and stands
in for an accelerator on the host CPU under the name "example", so that everything below can be
tried on any machine.

1. **Announce the plugin.** In your ``pyproject.toml``, name your plugin module in the ``kvik``
   entry-point group. The entry-point name ("example") is what ``KVIK_PLUGINS=a,b`` allow-lists
   and what ``kvik env`` lists::

       [project.entry-points.kvik]
       example = "kvik_example_platform.plugin"

2. **Declare the plugin API you were built for.** kvik refuses a plugin whose
   ``KVIK_PLUGIN_API`` has another major version, or a newer minor one, and says both versions::

       KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION

3. **Return your Platform class** from ``kvik_platform()``, always, also on machines without your
   hardware. Import it inside the hook and keep its module light: kvik imports every installed
   platform to ask ``is_present()``.

4. **Write the Platform** (``kvik_example_platform.platform``): a subclass of
   ``kvik.platforms.Platform`` with a ``name``, ``device_type``, ``dist_backend``, a ``priority``
   (the CPU has 0, the GPU platforms 100; here 50), the dtypes you support, your attention
   backends in order of preference, a cheap ``is_present()`` that loads no kernels and creates
   no device context, and your device's ``total_memory_bytes()`` and ``free_memory_bytes()`` (the
   KV cache is sized from them). Register your kernels in ``on_selected()``, which kvik calls once
   your platform is chosen, never on import; ops you register no kernel for run kvik's PyTorch
   references. Everything else has a default in ``Platform``; override only what differs. For
   quantized models, list the methods you run in ``supported_quantization`` (the example lists
   none, so ``--quantization fp8`` is refused on it by name) and return your own kernels from
   ``linear_kernel(scheme, layer)`` where you have them; the default runs kvik's PyTorch ones
   (docs/architecture.md, "Quantization").

5. **Register what you implement** through the ``kvik_register_*`` hooks. Each receives a
   ``register(name, target)`` callable; the target is an import path ("pkg.module:Attr") or a
   factory, imported only when chosen::

       @kvik.hookimpl
       def kvik_register_attention_backends(register):
           register("MY_ATTN", "kvik_myaccel.attention:MyAttentionBackend")

   This example registers "EXAMPLE_SDPA" (``kvik_example_platform.attention``): the paged cache
   read back request by request and attended with PyTorch's SDPA, the plainest correct backend.

6. **Try it.** The platform is present when ``KVIK_EXAMPLE_PLATFORM=1``::

       pip install ./examples/platform-plugin
       KVIK_EXAMPLE_PLATFORM=1 KVIK_DEVICE=example kvik env

   ``kvik env`` lists the plugin with its distribution and version, and the platform as present
   and selected. Without ``KVIK_DEVICE`` kvik picks the present platform of highest priority, so a
   present "example" (50) wins over the CPU (0) and loses to a GPU (100).
"""

from __future__ import annotations

import kvik

KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION


@kvik.hookimpl
def kvik_platform():
    from kvik_example_platform.platform import ExamplePlatform

    return ExamplePlatform


@kvik.hookimpl
def kvik_register_attention_backends(register):
    register("EXAMPLE_SDPA", "kvik_example_platform.attention:ExampleAttentionBackend")
