"""Observers registered by name, so configs and the CLI can name them."""

from __future__ import annotations

from typing import Callable

__all__ = ["register", "get", "available"]

_REGISTRY: dict[str, Callable] = {}


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def register(name: str, ctor: Callable | None = None):
    """Register an observer constructor under ``name``.

    Use as a class decorator (``@register("minmax")``) or directly with a
    constructor (``register("kl", HistogramObserver.with_args(method="kl"))``).
    Names are case-insensitive and ``-`` equals ``_``.
    """
    key = _normalize(name)

    def _add(obj):
        if key in _REGISTRY and _REGISTRY[key] is not obj:
            raise ValueError(f"observer name {name!r} is already registered")
        _REGISTRY[key] = obj
        return obj

    return _add if ctor is None else _add(ctor)


def get(name: str) -> Callable:
    """The observer constructor registered as ``name``.

    Example:
        >>> from quantkit import observers
        >>> obs = observers.get("minmax")(dtype=torch.int8, qscheme=torch.per_tensor_symmetric)

    Raises:
        ValueError: if no observer has that name (the message lists the known names).
    """
    if not isinstance(name, str):
        raise TypeError(f"observer name must be a string, got {type(name).__name__}")
    try:
        return _REGISTRY[_normalize(name)]
    except KeyError:
        raise ValueError(
            f"unknown observer {name!r}; choose one of: {', '.join(available())}"
        ) from None


def available() -> list[str]:
    """Sorted list of the registered observer names."""
    return sorted(_REGISTRY)
