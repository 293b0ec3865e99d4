"""The compaction methods by the name requests use (`method`): the built-in ones register
themselves when `engine.compaction.methods` is imported, a new one when its file is."""

from __future__ import annotations

from cdlm_serve.engine.compaction.methods.base import CompactionMethod

METHODS: dict[str, CompactionMethod] = {}


def register(method: CompactionMethod) -> CompactionMethod:
    """Add a method under its name (a second method of one name is a mistake, refused)."""
    if method.name in METHODS and type(METHODS[method.name]) is not type(method):
        raise ValueError(f"a compaction method named {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    METHODS.pop(name, None)


def method(name: str) -> CompactionMethod:
    """The registered method `name` (ValueError naming the known ones if there is none)."""
    found = METHODS.get(name)
    if found is None:
        raise ValueError(f"unknown compaction method {name!r}; known: {', '.join(METHODS)}")
    return found
