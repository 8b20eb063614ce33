"""Platform selection rules and their errors, with throwaway platform plugins."""

from __future__ import annotations

import pytest

import kvik
from kvik.platforms.base import MEMORY_UTILIZATION, Platform
from kvik.platforms.selection import PlatformError, select_platform, survey
from kvik.plugins.manager import PLUGIN_API_VERSION, KvikPluginManager


def fake_platform(name: str, present: bool, priority: int = 0) -> type[Platform]:
    def is_present(cls) -> bool:
        return present

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


@pytest.fixture(autouse=True)
def no_device_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVIK_DEVICE", raising=False)


def manager_with(*platforms: type[Platform]) -> KvikPluginManager:
    manager = KvikPluginManager()
    for cls in platforms:
        assert manager.add_plugin(PlatformPlugin(cls), f"{cls.name}-plugin")
    return manager


def test_highest_priority_present_platform_wins() -> None:
    manager = manager_with(
        fake_platform("cpu", True, 0),
        fake_platform("gpu", True, 100),
        fake_platform("absent", False, 200),
    )
    assert select_platform(manager=manager).name == "gpu"


def test_explicit_device_beats_priority() -> None:
    manager = manager_with(fake_platform("cpu", True, 0), fake_platform("gpu", True, 100))
    assert select_platform("cpu", manager=manager).name == "cpu"


def test_kvik_device_names_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = manager_with(fake_platform("cpu", True, 0), fake_platform("gpu", True, 100))
    monkeypatch.setenv("KVIK_DEVICE", "cpu")
    assert select_platform(manager=manager).name == "cpu"
    assert select_platform("gpu", manager=manager).name == "gpu"  # the argument comes first


def test_equal_priority_is_an_error_naming_both() -> None:
    manager = manager_with(fake_platform("cuda", True, 100), fake_platform("vendor", True, 100))
    with pytest.raises(PlatformError) as excinfo:
        select_platform(manager=manager)
    message = str(excinfo.value)
    assert "cuda (plugin cuda-plugin)" in message and "vendor (plugin vendor-plugin)" in message
    assert "KVIK_DEVICE" in message


def test_failed_plugin_stops_automatic_selection() -> None:
    manager = manager_with(fake_platform("cpu", True, 0))
    broken = PlatformPlugin(fake_platform("gpu", True, 100))
    broken.KVIK_PLUGIN_API = "2.0"
    assert not manager.add_plugin(broken, "gpu-plugin", dist="kvik-gpu")
    with pytest.raises(PlatformError, match="'gpu-plugin' \\(from kvik-gpu\\) failed to load"):
        select_platform(manager=manager)
    # Naming the device is still allowed: the user chose knowingly.
    assert select_platform("cpu", manager=manager).name == "cpu"


def test_explicit_device_not_present_says_what_was_found() -> None:
    manager = manager_with(fake_platform("cpu", True, 0), fake_platform("gpu", False, 100))
    with pytest.raises(PlatformError) as excinfo:
        select_platform("gpu", manager=manager)
    message = str(excinfo.value)
    assert "'gpu'" in message and "not present" in message
    assert "cpu (present)" in message and "gpu (not present)" in message


def test_unknown_device_says_what_was_found() -> None:
    manager = manager_with(fake_platform("cpu", True, 0))
    with pytest.raises(PlatformError, match="no platform named 'tpu'; found: cpu \\(present\\)"):
        select_platform("tpu", manager=manager)


def test_nothing_present_is_an_error() -> None:
    manager = manager_with(fake_platform("gpu", False, 100))
    with pytest.raises(PlatformError, match="no platform is present; found: gpu \\(not present\\)"):
        select_platform(manager=manager)


def test_no_platform_installed_says_how_to_install_one() -> None:
    with pytest.raises(PlatformError, match="pip install 'kvik\\[cpu\\]'"):
        select_platform(manager=KvikPluginManager())


def test_is_present_that_raises_counts_as_absent_with_its_error() -> None:
    def is_present(cls) -> bool:
        raise OSError("driver mismatch")

    flaky = type("Flaky", (Platform,), {"name": "flaky", "priority": 100})
    flaky.is_present = classmethod(is_present)
    manager = manager_with(fake_platform("cpu", True, 0), flaky)
    statuses = {s.cls.name: s for s in survey(manager)}
    assert not statuses["flaky"].present
    assert statuses["flaky"].error == "OSError: driver mismatch"
    assert select_platform(manager=manager).name == "cpu"
    with pytest.raises(PlatformError, match="not present: OSError: driver mismatch"):
        select_platform("flaky", manager=manager)


def test_default_kv_cache_takes_a_share_of_free_memory() -> None:
    class Device(Platform):
        @classmethod
        def free_memory_bytes(cls) -> int:
            return 10 * 1024**3

    assert Device.default_kv_cache_bytes(None) == int(10 * 1024**3 * MEMORY_UTILIZATION)


def test_cpu_platform_reports_cores_memory_and_bf16() -> None:
    from kvik_cpu.platform import CpuPlatform

    details = CpuPlatform.details()
    assert CpuPlatform.is_present()
    assert details["cores"] >= 1
    assert details["total_memory_bytes"] > 0
    assert isinstance(details["native_bf16"], bool)
    assert CpuPlatform.dist_backend == "gloo"
    assert CpuPlatform.default_dtype() == ("bfloat16" if details["native_bf16"] else "float32")
