"""Out-of-tree plugins installed into a fresh venv, the way a vendor's user installs them.

The venv reuses this environment's packages (torch, kvik) through a .pth file, so only the plugin
under test is installed into it, with pip, offline.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "platform-plugin"


def make_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # addsitedir (not a bare path) so the editable installs' own .pth files are read too.
    lines = [f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()]
    (Path(purelib) / "_kvik_parent_env.pth").write_text("\n".join(lines) + "\n")
    return python


def pip_install(python: Path, project: Path) -> None:
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(project),
        ],
        check=True,
        timeout=300,
    )


def kvik_env(python: Path, **env: str) -> tuple[int, dict[str, Any]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVIK_")}
    result = subprocess.run(
        [str(python), "-m", "kvik", "env", "--json"],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, json.loads(result.stdout)


def test_example_platform_is_listed_present_and_selected(tmp_path: Path, tiny_model) -> None:
    python = make_venv(tmp_path / "venv")
    pip_install(python, EXAMPLE)

    rc, report = kvik_env(python)
    assert rc == 0 and report["errors"] == []
    [plugin] = [p for p in report["plugins"] if p["name"] == "example"]
    assert (plugin["dist"], plugin["version"]) == ("kvik-example-platform", "0.1.0")
    platforms = {p["name"]: p for p in report["platforms"]}
    assert not platforms["example"]["present"]
    assert platforms["cpu"]["selected"]

    rc, report = kvik_env(python, KVIK_EXAMPLE_PLATFORM="1", KVIK_DEVICE="example")
    assert rc == 0 and report["errors"] == []
    platforms = {p["name"]: p for p in report["platforms"]}
    assert platforms["example"]["present"] and platforms["example"]["selected"]
    assert platforms["example"]["priority"] == 50
    assert platforms["example"]["attention_backends"] == ["EXAMPLE_SDPA"]
    registered = {b["name"]: b["plugin"] for b in report["attention_backends"]}
    assert registered["EXAMPLE_SDPA"] == "example"
    assert not platforms["cpu"]["selected"]

    # Present, it outranks the CPU (50 > 0) without being named.
    _, report = kvik_env(python, KVIK_EXAMPLE_PLATFORM="1")
    assert report["selected_platform"] == "example"

    # Selected, it runs the engine with its own attention backend: the same greedy tokens as the
    # CPU platform gives, for a batch of prompts of different lengths.
    script = textwrap.dedent(
        f"""
        import json
        from kvik import LLM, SamplingParams
        llm = LLM({str(tiny_model("llama"))!r}, dtype="float32", num_kv_blocks=64, enforce_eager=True)
        prompts = [[5, 6, 7, 8, 9], list(range(1, 40)), [7, 3]]
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        print(json.dumps([llm.engine.platform.name, llm.engine.runner.backend.name,
                          [o.outputs[0].token_ids for o in out]]))
        """
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVIK_")}
    runs = {}
    for device in ("example", "cpu"):
        result = subprocess.run(
            [str(python), "-c", script],
            env=clean | {"KVIK_EXAMPLE_PLATFORM": "1", "KVIK_DEVICE": device},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        name, backend, tokens = json.loads(result.stdout.strip().splitlines()[-1])
        assert name == device and all(len(t) == 8 for t in tokens)
        assert (backend == "EXAMPLE_SDPA") == (device == "example")
        runs[device] = tokens
    assert runs["example"] == runs["cpu"]


def test_plugin_that_raises_on_import_is_named(tmp_path: Path) -> None:
    project = tmp_path / "broken-plugin"
    (project / "src" / "kvik_broken_plugin").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["hatchling"]
            build-backend = "hatchling.build"

            [project]
            name = "kvik-broken-plugin"
            version = "0.0.1"

            [project.entry-points.kvik]
            broken = "kvik_broken_plugin"

            [tool.hatch.build.targets.wheel]
            packages = ["src/kvik_broken_plugin"]
            """
        )
    )
    (project / "src" / "kvik_broken_plugin" / "__init__.py").write_text(
        'raise RuntimeError("vendor driver bindings are missing")\n'
    )
    python = make_venv(tmp_path / "venv")
    pip_install(python, project)

    rc, report = kvik_env(python)
    assert rc == 1
    assert report["errors"] == [
        {
            "name": "broken",
            "dist": "kvik-broken-plugin",
            "hook": None,
            "error": "RuntimeError: vendor driver bindings are missing",
        }
    ]
    assert report["selected_platform"] is None
    assert "'broken' (from kvik-broken-plugin) failed to load" in report["selection_error"]
    assert not any(p["selected"] for p in report["platforms"])
    # The built-ins still loaded and are listed.
    assert {"cpu", "cuda", "rocm"} <= {p["name"] for p in report["platforms"]}
