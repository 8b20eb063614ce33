"""``kvik env``, run as a user runs it: in a subprocess of this environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvik
from kvik.cli.env import collect
from kvik.platforms.base import Platform
from kvik.plugins.manager import PLUGIN_API_VERSION, KvikPluginManager

ENV_KEYS = {
    "kvik_version",
    "python_version",
    "torch_version",
    "plugins",
    "platforms",
    "attention_backends",
    "quantization_methods",
    "models",
    "errors",
}


def kvik_env(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVIK_")}
    return subprocess.run(
        [sys.executable, "-m", "kvik", "env", *args],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_env_json_lists_the_built_ins() -> None:
    result = kvik_env("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert ENV_KEYS <= report.keys()
    assert report["kvik_version"] == kvik.__version__
    assert report["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert report["torch_version"].startswith("2.")
    assert report["errors"] == []
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["cuda"] == {
        "name": "cuda",
        "dist": "kvik-cuda",
        "version": kvik.__version__,
        "module": "kvik_cuda.plugin",
    }
    assert {"cpu", "rocm", "models"} <= plugins.keys()
    platforms = {p["name"]: p for p in report["platforms"]}
    assert platforms["cpu"]["present"] and platforms["cpu"]["selected"]
    assert platforms["cpu"]["details"]["cores"] >= 1
    for name in ("cuda", "rocm"):
        assert not platforms[name]["present"] and not platforms[name]["selected"]
    assert report["selected_platform"] == "cpu"
    assert {
        "name": "TORCH_SDPA",
        "plugin": "cpu",
        "target": "kvik_cpu.attention:TorchSdpaBackend",
    } in (report["attention_backends"])
    assert "LlamaForCausalLM" in {m["name"] for m in report["models"]}
    # core registers its quantization methods through the hook, as its plugin "quantization"
    assert plugins["quantization"]["module"] == "kvik.quantization.plugin"
    assert {
        "name": "fp8",
        "plugin": "quantization",
        "target": "kvik.quantization.fp8:Fp8Config",
    } in (report["quantization_methods"])
    assert platforms["cpu"]["quantization_methods"] == ["compressed-tensors", "fp8", "modelopt"]
    assert platforms["rocm"]["quantization_methods"] == []


def test_env_text_through_the_console_script() -> None:
    script = Path(sys.executable).parent / "kvik"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVIK_")}
    result = subprocess.run(
        [str(script), "env"], env=clean, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert f"kvik {kvik.__version__}" in result.stdout
    assert "* cpu" in result.stdout and "selected: cpu" in result.stdout
    # each platform's quantization methods, under its name
    cpu_section = result.stdout.split("* cpu", 1)[1]
    assert "quantization: compressed-tensors, fp8, modelopt" in cpu_section.splitlines()[1]


def test_env_reports_an_absent_explicit_device() -> None:
    result = kvik_env("--json", KVIK_DEVICE="cuda")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["selected_platform"] is None
    assert "'cuda'" in report["selection_error"] and "cpu (present)" in report["selection_error"]
    assert not any(p["selected"] for p in report["platforms"])


def test_allow_list_shows_in_env() -> None:
    report = json.loads(kvik_env("--json", KVIK_PLUGINS="cpu").stdout)
    assert [p["name"] for p in report["plugins"]] == ["cpu"]
    assert report["models"] == []


def test_env_imports_no_kernel_module_and_no_triton() -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from kvik.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['env', '--json'])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVIK_")}
    result = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    modules = set(json.loads(result.stdout))
    assert "kvik_cuda.platform" in modules  # the check below would see a kernel module load
    assert not {m for m in modules if m == "triton" or m.startswith("triton.")}
    plugin_modules = {m for m in modules if m.startswith("kvik_") and "." in m}
    # kvik_cpu.isa: the CPU's kernel paths from its flags, no kernel (kvik env shows them)
    assert {m.split(".", 1)[1] for m in plugin_modules} <= {"plugin", "platform", "isa"}
    for heavy in ("kvik.ops", "kvik.attention", "kvik.layers", "kvik.engine", "kvik.worker"):
        assert heavy not in modules


def test_cli_lists_subcommands_and_rejects_unknown_ones() -> None:
    helped = subprocess.run(
        [sys.executable, "-m", "kvik", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0 and "env" in helped.stdout
    unknown = subprocess.run(
        [sys.executable, "-m", "kvik", "nosuch"], capture_output=True, text=True, timeout=60
    )
    assert unknown.returncode == 2 and "invalid choice: 'nosuch'" in unknown.stderr


def test_collect_reports_a_platform_whose_details_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIK_DEVICE", raising=False)

    class Odd(Platform):
        name = "odd"

        @classmethod
        def is_present(cls) -> bool:
            return True

        @classmethod
        def details(cls) -> dict:
            raise RuntimeError("sensor offline")

    class Plugin:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_platform(self):
            return Odd

    manager = KvikPluginManager()
    manager.add_plugin(Plugin(), "odd", dist="kvik-odd", version="1.2")
    report = collect(manager=manager)
    [platform] = report["platforms"]
    assert platform["selected"] and platform["plugin"] == "odd"
    assert platform["details"] == {"error": "RuntimeError: sensor offline"}
    assert report["plugins"] == [
        {"name": "odd", "dist": "kvik-odd", "version": "1.2", "module": "Plugin"}
    ]
