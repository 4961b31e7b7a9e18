"""The one place that maps method names to DraftMethod classes.

A method module registers its class with `@register`; the CLI, the service
and tests choose methods by name through `create`, so adding a method never
means another `if method == ...` branch elsewhere. Built-in methods are
imported on first use, not when this module is imported, so choosing one
method does not pay for another's imports.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, TypeVar

from drafter.method import DraftMethod

M = TypeVar("M", bound=type[DraftMethod])

# Modules whose import registers the built-in methods.
_BUILTIN_MODULES = ("drafter.ngram", "drafter.draft_model", "drafter.eagle", "drafter.suffix")

_METHODS: dict[str, type[DraftMethod]] = {}


def register(cls: M) -> M:
    """Class decorator: make `cls` available as `cls.name`."""
    if not (isinstance(cls, type) and issubclass(cls, DraftMethod)):
        raise TypeError(f"{cls!r} is not a DraftMethod subclass")
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no registry name (set its class attribute "
                         "`name`)")
    known = _METHODS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"method name {cls.name!r} is taken by {known.__module__}."
                         f"{known.__qualname__}")
    _METHODS[cls.name] = cls
    return cls


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def method_names() -> list[str]:
    """Registered method names, sorted."""
    _load_builtins()
    return sorted(_METHODS)


def method_class(name: str) -> type[DraftMethod]:
    """The class registered as `name`; ValueError naming the known methods otherwise."""
    _load_builtins()
    cls = _METHODS.get(name)
    if cls is None:
        raise ValueError(f"unknown draft method {name!r}; known: {', '.join(sorted(_METHODS))}")
    return cls


def method_options(name: str) -> list[str]:
    """Keyword arguments the method's constructor takes (what `create` may pass)."""
    return [p.name for p in inspect.signature(method_class(name)).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def create(name: str, **kwargs: Any) -> DraftMethod:
    """Build the method registered as `name` from its constructor keywords."""
    unknown = sorted(set(kwargs) - set(method_options(name)))
    if unknown:
        raise ValueError(f"draft method {name!r} takes no option {', '.join(unknown)}; "
                         f"it takes: {', '.join(method_options(name)) or 'none'}")
    return method_class(name)(**kwargs)
