"""Which modules a graph node came from, read from torch.export's ``nn_module_stack``."""

from __future__ import annotations

from torch.fx import Node

__all__ = ["type_name", "module_scopes"]

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
