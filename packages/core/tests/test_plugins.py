"""Plugin loading: real entry points, throwaway plugins, the allow-list, the API version check."""

from __future__ import annotations

import sys

import pytest

import kvik
from kvik.plugins.manager import PLUGIN_API_VERSION, KvikPluginManager

BUILT_INS = {
    "cpu": "kvik-cpu",
    "cuda": "kvik-cuda",
    "rocm": "kvik-rocm",
    "models": "kvik-models",
}


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> KvikPluginManager:
    monkeypatch.delenv("KVIK_PLUGINS", raising=False)
    return KvikPluginManager()


class Registering:
    """A throwaway plugin registering one model architecture."""

    KVIK_PLUGIN_API = PLUGIN_API_VERSION

    def __init__(self, target: object = "tests_fake:Model") -> None:
        self.target = target

    @kvik.hookimpl
    def kvik_register_models(self, register):
        register("FakeForCausalLM", self.target)


def with_api(version: str | None) -> object:
    plugin = Registering()
    plugin.KVIK_PLUGIN_API = version
    return plugin


def test_built_ins_load_through_their_entry_points(manager: KvikPluginManager) -> None:
    manager.load_entry_points()
    loaded = {p.name: p for p in manager.plugins}
    assert manager.errors == []
    for name, dist in BUILT_INS.items():
        assert loaded[name].dist == dist
        assert loaded[name].version == kvik.__version__
    assert loaded["cpu"].module == "kvik_cpu.plugin"
    assert {cls.name for _, cls in manager.platforms()} >= {"cpu", "cuda", "rocm"}
    assert "TORCH_SDPA" in manager.attention_backends
    assert manager.attention_backends.owners["TORCH_SDPA"] == "cpu"
    assert "LlamaForCausalLM" in manager.models


def test_allow_list_applies_to_built_ins(
    manager: KvikPluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVIK_PLUGINS", "cpu, rocm")
    manager.load_entry_points()
    assert sorted(p.name for p in manager.plugins) == ["cpu", "rocm"]
    assert sorted(cls.name for _, cls in manager.platforms()) == ["cpu", "rocm"]
    assert manager.models.names() == []


def test_empty_allow_list_allows_everything(
    manager: KvikPluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVIK_PLUGINS", "")
    manager.load_entry_points()
    assert {p.name for p in manager.plugins} >= set(BUILT_INS)


def test_throwaway_plugin_registers(manager: KvikPluginManager) -> None:
    assert manager.add_plugin(Registering(), "fake", dist="fake-dist", version="9.9")
    assert manager.models.names() == ["FakeForCausalLM"]
    assert manager.models.owners["FakeForCausalLM"] == "fake"
    assert [(p.name, p.dist, p.version) for p in manager.plugins] == [("fake", "fake-dist", "9.9")]


@pytest.mark.parametrize("declared", ["2.0", "1.99", "0.9"])
def test_incompatible_api_is_refused_with_both_versions(
    manager: KvikPluginManager, declared: str
) -> None:
    assert not manager.add_plugin(with_api(declared), "future", dist="kvik-future")
    assert manager.plugins == []
    assert manager.models.names() == []
    [error] = manager.errors
    assert error.name == "future" and error.dist == "kvik-future"
    assert declared in error.error and PLUGIN_API_VERSION in error.error
    assert "'future'" in str(error)


def test_missing_api_declaration_is_refused(manager: KvikPluginManager) -> None:
    assert not manager.add_plugin(with_api(None), "undeclared")
    [error] = manager.errors
    assert "KVIK_PLUGIN_API" in error.error and PLUGIN_API_VERSION in error.error


def test_malformed_api_declaration_is_refused(manager: KvikPluginManager) -> None:
    assert not manager.add_plugin(with_api("one"), "odd")
    assert "MAJOR.MINOR" in manager.errors[0].error


def test_plugin_that_raises_is_reported_and_unregistered(manager: KvikPluginManager) -> None:
    class Raising:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_register_models(self, register):
            raise RuntimeError("broken registration")

    plugin = Raising()
    assert not manager.add_plugin(plugin, "raising", dist="kvik-raising")
    assert not manager.pm.is_registered(plugin)
    [error] = manager.errors
    assert (error.name, error.dist) == ("raising", "kvik-raising")
    assert "RuntimeError: broken registration" in error.error


def test_platform_hook_that_raises_is_reported(manager: KvikPluginManager) -> None:
    class BadPlatform:
        KVIK_PLUGIN_API = PLUGIN_API_VERSION

        @kvik.hookimpl
        def kvik_platform(self):
            raise ImportError("no driver bindings")

    assert manager.add_plugin(BadPlatform(), "bad")
    assert manager.platforms() == []
    assert "ImportError: no driver bindings" in manager.errors[0].error


def test_same_name_for_two_targets_is_an_error(manager: KvikPluginManager) -> None:
    assert manager.add_plugin(Registering(), "first")
    assert not manager.add_plugin(Registering("tests_fake:OtherModel"), "second")
    assert "'first'" in manager.errors[0].error and "'second'" in manager.errors[0].error


def test_same_name_for_the_same_target_is_shared(manager: KvikPluginManager) -> None:
    """Two plugins may register one implementation under one name (kvik-cuda and kvik-rocm both
    register TRITON_ATTN); the first keeps it."""
    assert manager.add_plugin(Registering(), "first")
    assert manager.add_plugin(Registering(), "second")
    assert manager.errors == []
    assert manager.models.owners["FakeForCausalLM"] == "first"


def test_import_path_target_resolves_lazily(
    manager: KvikPluginManager, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvik_lazy_target.py").write_text("class Model:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvik_lazy_target", raising=False)
    manager.add_plugin(Registering("kvik_lazy_target:Model"), "lazy")
    assert "kvik_lazy_target" not in sys.modules
    model = manager.models.resolve("FakeForCausalLM")
    assert model.__name__ == "Model" and model.__module__ == "kvik_lazy_target"
    assert manager.models.resolve("FakeForCausalLM") is model


def test_factory_target_is_called_once_on_resolve(manager: KvikPluginManager) -> None:
    calls = []

    def factory() -> str:
        calls.append(1)
        return "built"

    manager.add_plugin(Registering(factory), "factory")
    assert calls == []
    assert manager.models.resolve("FakeForCausalLM") == "built"
    assert manager.models.resolve("FakeForCausalLM") == "built"
    assert calls == [1]


def test_unknown_name_lists_the_registered_ones(manager: KvikPluginManager) -> None:
    manager.add_plugin(Registering(), "fake")
    with pytest.raises(ValueError, match="unknown model architecture 'Nope'.*FakeForCausalLM"):
        manager.models.resolve("Nope")
