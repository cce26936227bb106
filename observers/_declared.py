"""declaring: an observer constructor whose observers carry extra declared attributes."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["declaring"]


class declaring:  # noqa: N801 - used like with_args
    """Wrap an observer constructor so that every observer it builds also declares ``attrs``
    (e.g. ``weight_algorithm="gptq"`` on W8A8's per-channel weight observers). It behaves
    as the constructor it wraps: calling it builds an observer, ``with_args`` binds arguments.

    Example:
        >>> ctor = declaring(observers.get("per_channel_minmax"), weight_algorithm="gptq")
        >>> ctor().weight_algorithm
        'gptq'
    """

    def __init__(self, ctor: Callable, **attrs: Any) -> None:
        self.ctor = ctor
        self.attrs = attrs

    def __call__(self, *args, **kwargs):
        obs = self.ctor(*args, **kwargs)
        for name, value in self.attrs.items():
            setattr(obs, name, value)
        return obs

    def with_args(self, **kwargs) -> "declaring":
        inner = self.ctor.with_args(**kwargs) if hasattr(self.ctor, "with_args") else (
            lambda *a, **k: self.ctor(*a, **{**kwargs, **k}))
        return declaring(inner, **self.attrs)

    def __repr__(self) -> str:
        return f"declaring({self.ctor!r}, {self.attrs!r})"
