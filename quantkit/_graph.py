"""Graph and module helpers that every stage shares (the one home of each).

- dotted attributes: :func:`get_attr` / :func:`set_attr` (``"encoder.layer.0.weight"``);
- fresh attribute names: :func:`unique_attr_name`;
- which modules a node came from, read from torch.export's ``nn_module_stack``:
  :func:`type_name`, :func:`module_scopes`, :func:`scoped_config`.

This module sits at the bottom of the import graph beside ``_qmath`` and ``_errors``: it imports
nothing from quantkit, so observers, quantizers, kernels and every stage may use it.
"""

from __future__ import annotations

import torch
from torch.fx import Node

__all__ = ["get_attr", "set_attr", "unique_attr_name", "type_name", "module_scopes", "scoped_config"]


# --- dotted attributes ------------------------------------------------------------------------
def get_attr(root: torch.nn.Module, target: str):
    """The object at the dotted path ``target`` below ``root`` (a tensor, a module, ...)."""
    obj = root
    for atom in str(target).split("."):
        obj = getattr(obj, atom)
    return obj


def set_attr(root: torch.nn.Module, target: str, value: torch.Tensor, *, detach: bool = True) -> None:
    """Put ``value`` at the dotted path ``target`` below ``root``, in place.

    A parameter stays a parameter (``requires_grad=False``), a buffer stays a buffer, anything
    else becomes a plain attribute. The tensor that was there before (possibly the caller's) is
    replaced, not modified. ``detach=False`` stores ``value`` itself (for a tensor that must keep
    its identity, e.g. a fake tensor being materialized).
    """
    *path, name = str(target).split(".")
    owner = root.get_submodule(".".join(path)) if path else root
    if detach:
        value = value.detach()
    if name in owner._parameters:
        owner._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def unique_attr_name(root: torch.nn.Module, base: str, *, sep: str = "", start: int = 0) -> str:
    """The first of ``f"{base}{sep}{i}"`` for ``i = start, start + 1, ...`` that ``root`` does not have."""
    i = start
    while hasattr(root, f"{base}{sep}{i}"):
        i += 1
    return f"{base}{sep}{i}"


# --- module scopes ----------------------------------------------------------------------------
# strict-mode export prefixes module names with the traced ``self``
_EXPORT_PREFIXES = ("L['self'].", "L__self__.")


def type_name(t) -> str:
    """``"torch.nn.modules.linear.Linear"`` for a class (or the string export recorded)."""
    return t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"


def _strip(fqn: str) -> str:
    for prefix in _EXPORT_PREFIXES:
        if fqn.startswith(prefix):
            fqn = fqn[len(prefix):]
    return fqn


def module_scopes(node: Node) -> list[tuple[str, str]]:
    """``(module name, module type name)`` of every module enclosing ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(_strip(str(fqn)), type_name(t)) for fqn, t in stack.values()]


def scoped_config(node: Node, by_name: dict, by_type: dict, default):
    """The setting that applies to ``node``: the longest module name in ``by_name`` enclosing it (the
    module or a parent), else the innermost enclosing module type in ``by_type`` (type names, see
    :func:`type_name`), else ``default``. Values may be None (keep the node float)."""
    scopes = module_scopes(node)
    best, best_len = None, -1
    for name, cfg in by_name.items():
        for fqn, _ in scopes:
            if (fqn == name or fqn.startswith(name + ".")) and len(name) > best_len:
                best, best_len = cfg, len(name)
    if best_len >= 0:
        return best
    for _, tname in reversed(scopes):  # innermost module first
        if tname in by_type:
            return by_type[tname]
    return default
