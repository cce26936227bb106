"""``quantkit quantize --scheme NAME`` for a registered scheme the command line has no flags for.

The built-in presets (``w8a8``..., ``w4a16``..., ``fp8``...) resolve through the registry
(``quantkit.quantizers.get_scheme``) into the W8A8, weight-only and FP8 recipes, whose flags
refine them. Any other registered scheme (a ``SchemeConfig`` subclass registered with
``register_scheme``, e.g. by a plugin or a test) runs as its config says: its own
``quantizer()``, ``--skip`` through the quantizer's ``set_module_name``, and no recipe flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..quantizers._scheme import SchemeConfig, available_schemes, get_scheme, scheme_info
from . import _inputs as inputs

__all__ = ["SchemeRecipe", "presets_of"]

# flags that refine a built-in recipe; with another registered scheme they are usage errors
_RECIPE_FLAGS = (("--activation", "activation"), ("--dynamic", "dynamic"), ("--granularity", "granularity"),
                 ("--ops", "ops"), ("--observer", "observer"), ("--group-size", "group_size"),
                 ("--kv-cache", "kv_cache"), ("--kv-granularity", "kv_granularity"), ("--algorithm", "algorithm"),
                 ("--weight-bits", "weight_bits"), ("--smoothquant", "smoothquant"),
                 ("--accuracy-budget", "accuracy_budget"))


def presets_of(config_type: type) -> str:
    """The registered presets whose config is a ``config_type``, as ``"a, b or c"``."""
    names = [n for n in available_schemes() if isinstance(get_scheme(n), config_type)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1] if names else "(none)"


@dataclass(frozen=True)
class SchemeRecipe:
    """A registered scheme run as its config says (see the module docstring)."""

    scheme: str
    config: SchemeConfig

    @staticmethod
    def from_args(args, config: SchemeConfig) -> "SchemeRecipe":
        for flag, attr in _RECIPE_FLAGS:
            value = getattr(args, attr, None)
            if value is not None and value is not False:
                raise inputs.UsageError(f"{flag} has no effect with --scheme {args.scheme} (a registered "
                                        f"{type(config).TYPE} scheme: its config decides); drop it")
        if getattr(args, "weight_observer", "per_channel_minmax") != "per_channel_minmax":
            raise inputs.UsageError(f"--weight-observer has no effect with --scheme {args.scheme} (a registered "
                                    f"{type(config).TYPE} scheme: its config decides); drop it")
        return SchemeRecipe(args.scheme, config)

    def quantizer(self, skipped: list[str]):
        """The config's quantizer; ``skipped`` modules stay float (``set_module_name(name, None)``)."""
        quantizer = self.config.quantizer()
        if skipped and not callable(getattr(quantizer, "set_module_name", None)):
            raise inputs.UsageError(f"--skip needs a quantizer with set_module_name; scheme {self.scheme}'s "
                                    f"{type(quantizer).__name__} has none: drop --skip")
        for name in skipped:
            quantizer.set_module_name(name, None)
        return quantizer

    def to_json(self) -> dict:
        return {"scheme": self.scheme, "config_type": type(self.config).TYPE,
                "description": scheme_info(self.scheme).description}
