"""Calling kvik's hooks through pluggy one plugin at a time.

pluggy calls every implementation of a hook in one go and hands back their results without saying
whose is whose, and the first exception ends the call. kvik needs to know whose: a registry records
which plugin registered each name, and a plugin that raises is reported under its own name while
the others go on. So each implementation is called on its own, through a subset of the hook, in
the order pluggy would call them all (``tryfirst`` ones first, ``trylast`` ones last, otherwise the
last registered first) and inside every wrapper of the hook, so that ``wrapper=True`` and
``hookwrapper=True`` implementations see (and may change) each plugin's call.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import pluggy

from kvik.plugins import hookspecs

#: Every hook of kvik is named so; in a plugin, a function with this prefix is a hook.
HOOK_PREFIX = "kvik_"


class KvikPluggyManager(pluggy.PluginManager):
    """pluggy's manager for the "kvik" project, with kvik's hook specs.

    A ``kvik_*`` function without the ``kvik.hookimpl`` marker is taken as a hook implementation
    too (with no options), as pytest does for ``pytest_*``: a misspelled hook name is then reported
    by ``check_pending()`` with or without the marker, instead of never being called.
    """

    def __init__(self) -> None:
        super().__init__("kvik")
        self.add_hookspecs(hookspecs)

    def parse_hookimpl_opts(self, plugin: object, name: str) -> pluggy.HookimplOpts | None:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(HOOK_PREFIX):
            if inspect.isroutine(getattr(plugin, name, None)):
                return {}  # pluggy fills in the default options
        return opts


def spec_names(pm: pluggy.PluginManager) -> list[str]:
    """The names of the hooks kvik specifies."""
    return sorted(name for name, caller in vars(pm.hook).items() if caller.has_spec())


def unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    """The hooks ``plugin`` implements that kvik does not specify (and are not optional)."""
    return sorted(
        caller.name
        for caller in pm.get_hookcallers(plugin) or []
        if not caller.has_spec()
        and any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls())
    )


def is_wrapper(impl: pluggy.HookImpl) -> bool:
    return bool(impl.wrapper or impl.hookwrapper)


def call_order(pm: pluggy.PluginManager, hook: str) -> list[str]:
    """Names of the plugins implementing ``hook`` (wrappers aside), in pluggy's call order."""
    impls = getattr(pm.hook, hook).get_hookimpls()  # pluggy calls this list from its end
    return [impl.plugin_name for impl in reversed(impls) if not is_wrapper(impl)]


def call_one(
    pm: pluggy.PluginManager,
    hook: str,
    plugin_name: str,
    skip_wrappers: Iterable[str] = (),
    **kwargs: Any,
) -> list[Any]:
    """Call ``plugin_name``'s implementation of ``hook`` through pluggy, inside the hook's wrappers
    (but those of the plugins in ``skip_wrappers``), and return pluggy's list of results."""
    skip = set(skip_wrappers)
    others = [
        impl.plugin
        for impl in getattr(pm.hook, hook).get_hookimpls()
        if impl.plugin_name != plugin_name and (not is_wrapper(impl) or impl.plugin_name in skip)
    ]
    return pm.subset_hook_caller(hook, others)(**kwargs)


def _code(impl: pluggy.HookImpl) -> object:
    return getattr(impl.function, "__code__", None)


def culprit(pm: pluggy.PluginManager, hook: str, error: BaseException, called: str) -> str:
    """The plugin whose implementation of ``hook`` raised ``error``: the innermost of the hook's
    implementations in the traceback (a wrapper that re-raises what it wrapped is not blamed),
    else ``called``, the plugin that was being called."""
    impls = getattr(pm.hook, hook).get_hookimpls()
    found = called
    tb: TracebackType | None = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        matching = [impl for impl in impls if _code(impl) is frame.f_code]
        if len(matching) > 1:  # instances of one plugin class: tell them apart by ``self``
            this = frame.f_locals.get("self")
            matching = [impl for impl in matching if impl.plugin is this] or matching
        if matching:
            names = [impl.plugin_name for impl in matching]
            found = called if called in names else names[0]
        tb = tb.tb_next
    return found


def describe_error(error: BaseException) -> str:
    """One line for ``kvik env``: pluggy's validation messages span several."""
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}"
