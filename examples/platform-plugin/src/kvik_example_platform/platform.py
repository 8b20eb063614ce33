"""The example platform: kvik's CPU platform under its own name, present on request."""

from __future__ import annotations

import os

from kvik_cpu.platform import CpuPlatform


class ExamplePlatform(CpuPlatform):
    name = "example"
    priority = 50
    attention_backends = ("TORCH_SDPA",)  # registered by the cpu plugin

    @classmethod
    def is_present(cls) -> bool:
        return os.environ.get("KVIK_EXAMPLE_PLATFORM") == "1"
