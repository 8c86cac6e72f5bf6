"""Immutable, hashable containers for configuration values."""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping


class FrozenDict(Mapping):
    """A read-only, hashable mapping (hash of its canonical JSON form)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] = ()):  # type: ignore[assignment]
        object.__setattr__(self, "_data", dict(data))
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(json.dumps(thaw(self), sort_keys=True, default=repr)))
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is immutable")

    def __reduce__(self):
        return (FrozenDict, (self._data,))


def freeze(value: Any) -> Any:
    """Deep-convert dicts to :class:`FrozenDict` and lists to tuples."""
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of :func:`freeze`: plain dicts and lists, as JSON has them."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value
