"""Schemes as registered units: ``SchemeConfig`` (frozen, versioned, JSON round trip) and the
preset registry (``register_scheme`` / ``get_scheme`` / ``available_schemes`` / ``as_config``).

A scheme is a frozen dataclass subclassing :class:`SchemeConfig`; defining the subclass registers
its type name (``TYPE``, default the class name) so :meth:`SchemeConfig.from_dict` can rebuild it
from ``quantization.json``. A preset is a name bound to one config instance, registered beside the
config's definition (``quantizers/_config.py``: w8a8..., ``_weight_only.py``: w4a16..., ``_fp8.py``:
fp8...). The command line's ``--scheme`` lists :func:`available_schemes`.

Example:
    >>> cfg = as_config("w4a16")
    >>> SchemeConfig.from_dict(cfg.to_dict()) == cfg
    True
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from quantkit._errors import QuantkitError

__all__ = ["SchemeConfig", "SchemeError", "SchemeInfo", "register_scheme", "unregister_scheme", "get_scheme",
           "available_schemes",
           "scheme_info", "as_config", "config_types", "quantizer_for", "CONFIG_META_KEY"]

# GraphModule.meta key holding the SchemeConfig a model was quantized with (quantkit.quantize(scheme=...),
# quantkit.load of an artifact whose quantization.json records one as "config")
CONFIG_META_KEY = "quantkit_config"
_TYPES: dict[str, type] = {}  # TYPE -> SchemeConfig subclass
_SCHEMES: dict[str, "SchemeInfo"] = {}  # preset name -> its config and description, in registration order
_QUANTIZERS: dict[type, Callable] = {}  # SchemeConfig subclass -> factory(config) -> Quantizer


class SchemeError(QuantkitError):
    """An unknown scheme name or config type, or a config dictionary that cannot be read back."""


@dataclass(frozen=True)
class SchemeConfig:
    """Base of every scheme's settings: a frozen dataclass that serializes to plain JSON types.

    Subclasses are frozen dataclasses validated in ``__post_init__``; they set ``VERSION`` (bump
    it when a field changes meaning; :meth:`from_dict` refuses a newer one) and may set ``TYPE``
    (the name written to JSON; default the class name). Field values serialize as JSON types:
    enums as their values, frozensets/sets as sorted lists, tuples as lists; ``__post_init__``
    (or :meth:`from_dict`, from the field's default) turns them back.
    """

    VERSION: ClassVar[int] = 1
    TYPE: ClassVar[str] = "SchemeConfig"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("TYPE", cls.__name__)
        cls.TYPE = name
        old = _TYPES.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise SchemeError(f"config type {name!r} is already {old.__module__}.{old.__qualname__}; "
                              f"give {cls.__qualname__} another TYPE")
        _TYPES[name] = cls  # the same class defined again (a reloaded module) replaces itself

    def to_dict(self) -> dict:
        """``{"type": TYPE, "version": VERSION, "fields": {...}}`` in plain JSON types."""
        return {"type": type(self).TYPE, "version": type(self).VERSION,
                "fields": {f.name: _plain(getattr(self, f.name), f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def from_dict(cls, d: Any) -> "SchemeConfig":
        """The config :meth:`to_dict` wrote (of the registered subclass it names).

        Raises:
            SchemeError: (one line) not such a dictionary, an unknown type, a newer version, an
                unknown field, or values the config refuses.
        """
        if not isinstance(d, dict) or not isinstance(d.get("fields"), dict) or not isinstance(d.get("type"), str):
            raise SchemeError(f"a scheme config is a dictionary with 'type', 'version' and 'fields', got "
                              f"{_short(d)}")
        sub = _TYPES.get(d["type"])
        if sub is None:
            raise SchemeError(f"unknown scheme config type {_short(d['type'])}; known: {', '.join(sorted(_TYPES))} "
                              "(a config of another scheme needs the code that registers it imported first)")
        if cls is not SchemeConfig and not issubclass(sub, cls):
            raise SchemeError(f"config type {d['type']!r} is not a {cls.__name__}")
        version = d.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise SchemeError(f"{d['type']} config version must be a positive integer, got {_short(version)}")
        if version > sub.VERSION:
            raise SchemeError(f"{d['type']} config version {version} is newer than this quantkit reads "
                              f"({sub.VERSION}); upgrade quantkit")
        fields = {f.name: f for f in dataclasses.fields(sub) if f.init}
        unknown = sorted(set(d["fields"]) - set(fields))
        if unknown:
            raise SchemeError(f"unknown {d['type']} config fields {_short(unknown)}; known: {', '.join(fields)}")
        kwargs = {k: _typed(v, fields[k]) for k, v in d["fields"].items()}
        try:
            return sub(**kwargs)
        except (TypeError, ValueError) as exc:
            raise SchemeError(f"{d['type']} config: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
                from None

    def quantizer(self):
        """The quantizer that applies this config to the whole model (a torchao ``Quantizer``): the
        factory registered with :func:`quantizer_for` for this class (or a base), unless a subclass
        overrides this method."""
        for klass in type(self).__mro__:
            if klass in _QUANTIZERS:
                return _QUANTIZERS[klass](self)
        raise SchemeError(f"{type(self).__name__} names no quantizer: override quantizer() or register one "
                          "with quantizer_for")


@dataclass(frozen=True)
class SchemeInfo:
    """A registered preset: its name, config and one-line description."""

    name: str
    config: SchemeConfig
    description: str


def register_scheme(name: str, config: SchemeConfig, *, description: str) -> SchemeConfig:
    """Register the preset ``name`` (lower case, e.g. ``"w4a16"``) for ``config``; returns ``config``.

    Registering a name again with an equal config (a reloaded module) is allowed; with another one
    it is a :class:`SchemeError`.
    """
    if not isinstance(name, str) or not name or name != name.strip().lower() or " " in name:
        raise SchemeError(f"a scheme name is a lower-case word such as 'w4a16', got {name!r}")
    if not isinstance(config, SchemeConfig):
        raise SchemeError(f"scheme {name!r}: config must be a SchemeConfig, got {type(config).__name__}")
    if not isinstance(description, str) or not description.strip():
        raise SchemeError(f"scheme {name!r}: pass a one-line description")
    old = _SCHEMES.get(name)
    if old is not None and old.config != config:
        raise SchemeError(f"scheme {name!r} is already registered (as {old.config!r})")
    _SCHEMES[name] = SchemeInfo(name, config, description.strip())
    return config


def unregister_scheme(name: str) -> None:
    """Remove the preset ``name`` (a no-op if it is not registered): for a plugin or a test that
    registered one only for a while."""
    _SCHEMES.pop(name, None)


def available_schemes() -> list[str]:
    """The registered preset names, in registration order."""
    return list(_SCHEMES)


def scheme_info(name: str) -> SchemeInfo:
    """The registered preset ``name`` with its description (see :func:`get_scheme`)."""
    info = _SCHEMES.get(name.strip().lower() if isinstance(name, str) else name)
    if info is None:
        raise SchemeError(f"unknown scheme {name!r}; known: {', '.join(_SCHEMES)}")
    return info


def get_scheme(name: str) -> SchemeConfig:
    """The config registered as ``name``; an unknown name is a one-line :class:`SchemeError`."""
    return scheme_info(name).config


def as_config(x: "str | SchemeConfig") -> SchemeConfig:
    """``x`` itself if it is a :class:`SchemeConfig`, else the preset it names."""
    if isinstance(x, SchemeConfig):
        return x
    if isinstance(x, str):
        return get_scheme(x)
    raise SchemeError(f"a scheme is a preset name ({', '.join(_SCHEMES)}) or a SchemeConfig, got "
                      f"{type(x).__name__}")


def quantizer_for(config_type: type) -> Callable:
    """Decorator: ``factory(config) -> Quantizer`` (e.g. a quantizer class taking the config) is what
    ``config_type.quantizer()`` returns. For a quantizer defined in another module than its config
    (``W8A8Quantizer`` and ``QuantConfig``), so the config's module need not import it."""
    if not (isinstance(config_type, type) and issubclass(config_type, SchemeConfig)):
        raise SchemeError(f"quantizer_for takes a SchemeConfig subclass, got {config_type!r}")

    def register(factory: Callable) -> Callable:
        _QUANTIZERS[config_type] = factory
        return factory

    return register


def config_types() -> dict[str, type]:
    """Registered config types: ``TYPE`` -> class."""
    return dict(_TYPES)


def _plain(value: Any, where: str):
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (frozenset, set)):
        return sorted(_plain(v, where) for v in value)
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    raise TypeError(f"config field {where!r} holds a {type(value).__name__}, which has no JSON form")


def _typed(value: Any, f: dataclasses.Field):
    """A JSON list back in the container the field's default has (frozenset, tuple)."""
    if not isinstance(value, list):
        return value
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    kind = str(f.type)
    if isinstance(default, (frozenset, set)) or kind.startswith(("frozenset", "set")):
        return frozenset(_hashable(v) for v in value)
    if isinstance(default, tuple) or kind.startswith("tuple"):
        return tuple(value)
    return value


def _hashable(v: Any):
    return tuple(v) if isinstance(v, list) else v


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
