"""What plugins register: name -> import path or factory, with the plugin that registered it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from kvik.plugins import hookspecs


@dataclass
class Registry:
    """Name -> import path or factory, as plugins registered them; resolved on first use."""

    kind: str
    targets: dict[str, hookspecs.Target] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    _resolved: dict[str, Any] = field(default_factory=dict)

    def register_from(self, plugin: str):
        def register(name: str, target: hookspecs.Target) -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
            if name in self.targets and self.owners[name] != plugin:
                if self.targets[name] == target:
                    return  # several plugins share one implementation (TRITON_ATTN): the first owns it
                raise ValueError(
                    f"{self.kind} {name!r} is registered by both {self.owners[name]!r} "
                    f"and {plugin!r}"
                )
            self.targets[name] = target
            self.owners[name] = plugin

        return register

    def names(self) -> list[str]:
        return sorted(self.targets)

    def drop(self, plugin: str) -> None:
        """Forget every name ``plugin`` registered (it failed after registering them)."""
        for name in [n for n, owner in self.owners.items() if owner == plugin]:
            del self.targets[name], self.owners[name]
            self._resolved.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self.targets

    def resolve(self, name: str) -> Any:
        if name not in self.targets:
            known = ", ".join(self.names()) or "none"
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {known}")
        if name not in self._resolved:
            target = self.targets[name]
            if isinstance(target, str):
                module_name, _, attr = target.partition(":")
                obj: Any = importlib.import_module(module_name)
                for part in attr.split(".") if attr else []:
                    obj = getattr(obj, part)
            else:
                obj = target()
            self._resolved[name] = obj
        return self._resolved[name]
