"""One registry per plugin kind: validates and de-duplicates what plugins register."""
from __future__ import annotations

import re
from typing import Generic, Iterator, TypeVar

from .errors import PluginError, UnknownPluginError

T = TypeVar("T")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


class Registry(Generic[T]):
    """Name -> object for one kind, remembering which plugin registered each name."""

    def __init__(self, kind: str, hook: str, required: tuple[str, ...]):
        self.kind, self.hook, self.required = kind, hook, required
        self._items: dict[str, T] = {}
        self._origin: dict[str, str] = {}

    def add(self, obj: T, plugin: str) -> None:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(plugin, self.hook,
                              f"registered a {self.kind} with invalid name {name!r} "
                              "(want lower-case letters, digits, '-', '_' or '.')")
        missing = [a for a in self.required if not hasattr(obj, a)]
        if missing:
            raise PluginError(plugin, self.hook,
                              f"{self.kind} {name!r} lacks required attribute(s) {missing}")
        if name in self._items:
            if self._items[name] is obj or type(self._items[name]) is type(obj) and \
                    self._origin[name] == plugin:
                return  # the same thing registered twice: keep one
            raise PluginError(plugin, self.hook,
                              f"{self.kind} name {name!r} is already registered by plugin "
                              f"{self._origin[name]!r}")
        self._items[name] = obj
        self._origin[name] = plugin

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownPluginError(
                f"unknown {self.kind} {name!r}; registered {self.kind}s: "
                f"{', '.join(sorted(self._items)) or '(none)'}") from None

    def origin(self, name: str) -> str:
        return self._origin[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)
