"""Hooks are called through pluggy: unknown hooks, errors put down to their plugin, call order,
wrappers. Plugins are real objects and modules registered into a real manager; the entry-point ones
are real distributions (a dist-info folder on sys.path) found by importlib.metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvik
from kvik.cli.env import collect, format_text
from kvik.platforms.base import Platform
from kvik.platforms.selection import PlatformError, select_platform
from kvik.plugins.manager import PLUGIN_API_VERSION, KvikPluginManager


def fake_platform(name: str, priority: int = 0) -> type[Platform]:
    def is_present(cls) -> bool:
        return True

    return type(
        f"{name.title()}Platform",
        (Platform,),
        {"name": name, "priority": priority, "is_present": classmethod(is_present)},
    )


class PlatformPlugin:
    KVIK_PLUGIN_API = PLUGIN_API_VERSION

    def __init__(self, cls: type[Platform]) -> None:
        self.cls = cls

    @kvik.hookimpl
    def kvik_platform(self):
        return self.cls


class Misspelled:
    """Means ``kvik_platform``; marked, so pluggy takes it as a hook."""

    KVIK_PLUGIN_API = PLUGIN_API_VERSION

    @kvik.hookimpl
    def kvik_platfrom(self):
        return fake_platform("gpu", 100)


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> KvikPluginManager:
    monkeypatch.delenv("KVIK_PLUGINS", raising=False)
    monkeypatch.delenv("KVIK_DEVICE", raising=False)
    manager = KvikPluginManager()
    assert manager.add_plugin(PlatformPlugin(fake_platform("cpu")), "cpu-plugin", dist="kvik-cpu")
    return manager


def test_misspelled_hook_is_named_and_the_plugin_refused(manager: KvikPluginManager) -> None:
    plugin = Misspelled()
    assert not manager.add_plugin(plugin, "typo", dist="kvik-typo")
    assert not manager.pm.is_registered(plugin)
    assert [p.name for p in manager.plugins] == ["cpu-plugin"]
    [error] = manager.errors
    assert (error.name, error.dist, error.hook) == ("typo", "kvik-typo", "kvik_platfrom")
    assert "'kvik_platfrom', which is not a kvik hook (did you mean 'kvik_platform'?)" in str(error)


def test_misspelled_hook_stops_automatic_selection(manager: KvikPluginManager) -> None:
    manager.add_plugin(Misspelled(), "typo", dist="kvik-typo")
    with pytest.raises(PlatformError) as excinfo:
        select_platform(manager=manager)
    message = str(excinfo.value)
    assert "cannot choose a device automatically" in message
    assert "'typo' (from kvik-typo)" in message and "'kvik_platfrom'" in message
    assert select_platform("cpu", manager=manager).name == "cpu"  # named knowingly: allowed


def test_unmarked_hooks_count_too(manager: KvikPluginManager) -> None:
    class Unmarked:
        """No markers: a right name is a hook, a wrong ``kvik_`` name is an unknown hook."""

        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        def kvik_register_models(self, register):
            register("UnmarkedForCausalLM", "somewhere:Model")

        def kvik_register_model(self, register):
            register("TypoForCausalLM", "somewhere:Model")

    assert not manager.add_plugin(Unmarked(), "unmarked")
    assert [e.hook for e in manager.errors] == ["kvik_register_model"]
    assert "did you mean 'kvik_register_models'?" in manager.errors[0].error
    assert manager.models.names() == []  # refused before any hook ran

    class Correct:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        def kvik_register_models(self, register):
            register("UnmarkedForCausalLM", "somewhere:Model")

    assert manager.add_plugin(Correct(), "correct")
    assert manager.models.owners["UnmarkedForCausalLM"] == "correct"


def test_specname_names_the_hook(manager: KvikPluginManager) -> None:
    class Renamed:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl(specname="kvik_platform")
        def provide_platform(self):
            return fake_platform("renamed")

    assert manager.add_plugin(Renamed(), "renamed")
    assert sorted(cls.name for _, cls in manager.platforms()) == ["cpu", "renamed"]
    assert manager.errors == []


def test_marked_hook_without_the_prefix_lists_the_hooks(manager: KvikPluginManager) -> None:
    class Unprefixed:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def setup(self):
            pass

    assert not manager.add_plugin(Unprefixed(), "odd")
    [error] = manager.errors
    assert error.hook == "setup"
    assert "kvik's hooks: kvik_platform, kvik_register_attention_backends" in error.error


def test_optional_unknown_hook_is_allowed(manager: KvikPluginManager) -> None:
    class Newer:
        """A hook of a later kvik, marked optional as pluggy allows."""

        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl(optionalhook=True)
        def kvik_register_samplers(self, register):
            pass

    assert manager.add_plugin(Newer(), "newer")
    assert manager.errors == []


def test_hook_arguments_not_in_the_spec_are_refused(manager: KvikPluginManager) -> None:
    class WrongArgs:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_register_models(self, registry):
            pass

    plugin = WrongArgs()
    assert not manager.add_plugin(plugin, "wrong-args")
    assert not manager.pm.is_registered(plugin)
    [error] = manager.errors
    assert error.name == "wrong-args" and "registry" in error.error
    assert "\n" not in error.error  # one line in kvik env


def test_raising_hook_is_put_down_to_its_plugin(manager: KvikPluginManager) -> None:
    class Good:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_register_models(self, register):
            register("GoodForCausalLM", "good:Model")

    class Bad:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_register_attention_backends(self, register):
            register("BAD_ATTN", "bad:Backend")

        @kvik.hookimpl
        def kvik_register_models(self, register):
            raise RuntimeError("no such checkpoint format")

    assert manager.add_plugin(Good(), "good", dist="kvik-good")
    assert not manager.add_plugin(Bad(), "bad", dist="kvik-bad")
    [error] = manager.errors
    assert (error.name, error.dist, error.hook) == ("bad", "kvik-bad", "kvik_register_models")
    assert "kvik_register_models raised RuntimeError: no such checkpoint format" in error.error
    # What the failed plugin registered before it raised is forgotten; the other plugin's stays.
    assert "BAD_ATTN" not in manager.attention_backends
    assert manager.models.owners == {"GoodForCausalLM": "good"}


def test_raising_platform_hook_is_put_down_to_its_plugin(manager: KvikPluginManager) -> None:
    class NoDriver:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_platform(self):
            raise ImportError("no driver bindings")

    manager.add_plugin(NoDriver(), "nodriver", dist="kvik-nodriver")
    assert [(name, cls.name) for name, cls in manager.platforms()] == [("cpu-plugin", "cpu")]
    [error] = manager.errors
    assert (error.name, error.dist, error.hook) == ("nodriver", "kvik-nodriver", "kvik_platform")
    assert "ImportError: no driver bindings" in error.error
    assert manager.errors == [error]  # asking again does not report it twice


def test_platform_hook_returning_no_platform_class_is_an_error(
    manager: KvikPluginManager,
) -> None:
    manager.add_plugin(PlatformPlugin("cuda"), "stringly")  # type: ignore[arg-type]
    assert [name for name, _ in manager.platforms()] == ["cpu-plugin"]
    [error] = manager.errors
    assert (
        error.name == "stringly" and "returned 'cuda', which is not a kvik Platform" in error.error
    )


class Wrapper:
    """A new-style wrapper of ``kvik_platform``: sees every plugin's call and may change it."""

    KVIK_PLUGIN_API = PLUGIN_API_VERSION

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[str] = []

    @kvik.hookimpl(wrapper=True)
    def kvik_platform(self):
        if self.fail:
            raise RuntimeError("wrapper is broken")
        classes = yield
        self.seen += [cls.name for cls in classes]
        return [type(f"Traced{cls.__name__}", (cls,), {}) for cls in classes]


def test_wrappers_wrap_each_plugin_call(manager: KvikPluginManager) -> None:
    wrapper = Wrapper()
    assert manager.add_plugin(wrapper, "tracing")
    assert manager.add_plugin(PlatformPlugin(fake_platform("gpu", 100)), "gpu-plugin")
    platforms = dict(manager.platforms())
    assert sorted(wrapper.seen) == ["cpu", "gpu"]
    assert platforms["gpu-plugin"].__name__ == "TracedGpuPlatform"
    assert "tracing" not in platforms  # a wrapper provides no platform of its own
    assert select_platform(manager=manager).__name__ == "TracedGpuPlatform"


def test_raising_wrapper_is_blamed_not_the_wrapped_plugin(manager: KvikPluginManager) -> None:
    manager.add_plugin(Wrapper(fail=True), "broken-wrapper", dist="kvik-wrapper")
    assert [name for name, _ in manager.platforms()] == ["cpu-plugin"]  # called again without it
    [error] = manager.errors
    assert (error.name, error.dist) == ("broken-wrapper", "kvik-wrapper")
    assert "RuntimeError: wrapper is broken" in error.error


def test_wrapper_that_reraises_blames_the_wrapped_plugin(manager: KvikPluginManager) -> None:
    class Reraising:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl(wrapper=True)
        def kvik_register_models(self, register):
            return (yield)  # an exception from the wrapped plugin comes out of the yield

    class Raising:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_register_models(self, register):
            raise ValueError("bad architecture table")

    assert manager.add_plugin(Reraising(), "reraising")
    assert not manager.add_plugin(Raising(), "raising")
    assert [e.name for e in manager.errors] == ["raising"]
    assert {p.name for p in manager.plugins} == {"cpu-plugin", "reraising"}


def test_tryfirst_and_trylast_order_the_platforms(manager: KvikPluginManager) -> None:
    class First(PlatformPlugin):
        @kvik.hookimpl(tryfirst=True)
        def kvik_platform(self):
            return self.cls

    class Last(PlatformPlugin):
        @kvik.hookimpl(trylast=True)
        def kvik_platform(self):
            return self.cls

    # Registered first, middle, last: pluggy would otherwise call them last-registered first.
    manager.add_plugin(First(fake_platform("first")), "first")
    manager.add_plugin(PlatformPlugin(fake_platform("middle")), "middle")
    manager.add_plugin(Last(fake_platform("last")), "last")
    assert [name for name, _ in manager.platforms()] == ["first", "middle", "cpu-plugin", "last"]


def write_distribution(root: Path, dist: str, entry_point: str, source: str) -> None:
    """A plugin distribution as an installer leaves it: its module and a dist-info folder."""
    module = dist.replace("-", "_")
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvik]\n{entry_point} = {module}\n")


def registering(name: str, option: str = "") -> str:
    marker = f"kvik.hookimpl({option})" if option else "kvik.hookimpl"
    return f"""
        import kvik

        KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION

        @{marker}
        def kvik_register_models(register):
            register("SharedForCausalLM", "{name}:Model")
            register("{name.title()}ForCausalLM", "{name}:Model")
        """


def test_tryfirst_decides_registration_order_across_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_distribution(tmp_path, "kvik-hook-late", "late", registering("late", "trylast=True"))
    write_distribution(tmp_path, "kvik-hook-plain", "plain", registering("plain"))
    write_distribution(tmp_path, "kvik-hook-early", "early", registering("early", "tryfirst=True"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVIK_PLUGINS", "late,plain,early")
    manager = KvikPluginManager()
    manager.load_entry_points()
    # The tryfirst plugin registers first and so keeps the shared name; the others are refused.
    assert manager.models.owners == {"SharedForCausalLM": "early", "EarlyForCausalLM": "early"}
    assert [e.name for e in manager.errors] == ["plain", "late"]
    assert (
        "'SharedForCausalLM' is registered by both 'early' and 'plain'" in manager.errors[0].error
    )


def test_kvik_env_names_the_plugin_and_the_misspelled_hook(tmp_path: Path) -> None:
    source = """
        import kvik

        KVIK_PLUGIN_API = kvik.PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_register_attention_backend(register):
            register("TYPO_ATTN", "kvik_typo_plugin:Backend")
        """
    write_distribution(tmp_path, "kvik-typo-plugin", "typo", source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVIK_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))

    def kvik_env(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kvik", "env", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    result = kvik_env("--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["errors"] == [
        {
            "name": "typo",
            "dist": "kvik-typo-plugin",
            "hook": "kvik_register_attention_backend",
            "error": "it implements 'kvik_register_attention_backend', which is not a kvik hook "
            "(did you mean 'kvik_register_attention_backends'?)",
        }
    ]
    assert report["selected_platform"] is None
    assert "'typo' (from kvik-typo-plugin) failed to load" in report["selection_error"]
    assert "TYPO_ATTN" not in {b["name"] for b in report["attention_backends"]}
    assert report["errors"] and {"cpu", "cuda", "rocm"} <= {p["name"] for p in report["platforms"]}
    # The text report says the same (same report, formatted).
    text = kvik_env()
    assert text.returncode == 1
    assert (
        "  typo (kvik-typo-plugin): it implements 'kvik_register_attention_backend'" in text.stdout
    )
    assert "selected: none: cannot choose a device automatically" in text.stdout


def test_env_report_of_a_manager_with_a_misspelled_plugin(manager: KvikPluginManager) -> None:
    manager.add_plugin(Misspelled(), "typo", dist="kvik-typo")
    report = collect(manager=manager)
    assert report["errors"][0]["hook"] == "kvik_platfrom"
    assert "  typo (kvik-typo): it implements 'kvik_platfrom'" in format_text(report)
