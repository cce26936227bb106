"""Which modules a graph node came from, read from torch.export's ``nn_module_stack``."""

from __future__ import annotations

from torch.fx import Node

__all__ = ["type_name", "module_scopes", "scoped_config"]

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
