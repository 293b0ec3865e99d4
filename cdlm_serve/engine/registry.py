"""Named objects a request picks by name (a diffusion decoding mode, a compaction method): a
table that grows when a file registers one, so adding one changes nothing anywhere else."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """`items`: name -> the one registered object; `kind` names them in errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.items: dict[str, T] = {}

    def register(self, item: T) -> T:
        """Add `item` under its name (a second one of one name is a mistake, refused)."""
        known = self.items.get(item.name)
        if known is not None and type(known) is not type(item):
            raise ValueError(f"a {self.kind} named {item.name!r} is already registered")
        self.items[item.name] = item
        return item

    def unregister(self, name: str) -> None:
        self.items.pop(name, None)

    def get(self, name: str) -> T:
        """The registered `name` (ValueError naming the known ones if there is none)."""
        found = self.items.get(name)
        if found is None:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.items)}")
        return found
