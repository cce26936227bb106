"""``quantkit quantize --scheme fp8 | fp8-dynamic [--kv-cache FORMAT [--kv-granularity per-head]]
[--algorithm gptq]``: the FP8 recipes of the command line."""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import QuantkitError
from ..quantizers._fp8 import FP8Config
from . import _inputs as inputs
from ._registered import presets_of

__all__ = ["FP8Recipe", "describe_fp8"]


@dataclass(frozen=True)
class FP8Recipe:
    """The FP8 choices of one ``quantize`` run: a registered ``FP8Config`` preset (``fp8``: static
    E4M3 activations calibrated per tensor, ``fp8-dynamic``: per token at run time; E4M3 weights per
    output channel either way) refined by the flags (see ``quantizers.FP8Quantizer``)."""

    scheme: str
    observer: str = "minmax"
    kv_cache: str | None = None
    ops: tuple[str, ...] = ("linear", "matmul")
    algorithm: str = "rtn"  # --algorithm: how the E4M3 weights are rounded (FP8Config.weight_algorithm)
    kv_granularity: str = "per-tensor"  # --kv-granularity
    dynamic: bool = False  # the preset's (FP8Config.dynamic, .granularity)
    granularity: str = "per-tensor"

    @staticmethod
    def from_args(args, config=None) -> "FP8Recipe | None":
        """The FP8 recipe of ``--scheme`` (its registered ``config``), or None; ``--kv-cache`` without
        it, or flags that mean something only for the int8 recipes, are usage errors."""
        scheme, kv = args.scheme, getattr(args, "kv_cache", None)
        kv_granularity = getattr(args, "kv_granularity", None)
        if not isinstance(config, FP8Config):
            if kv is not None:
                raise inputs.UsageError(f"--kv-cache applies to the FP8 schemes; add --scheme {presets_of(FP8Config)}, "
                                        "or drop it")
            if kv_granularity is not None:
                raise inputs.UsageError("--kv-granularity applies to the FP8 schemes' --kv-cache; add --scheme fp8 "
                                        "--kv-cache FORMAT, or drop it")
            return None
        if kv_granularity is not None and kv is None:
            raise inputs.UsageError("--kv-granularity needs --kv-cache FORMAT (the KV cache it lays scales on); "
                                    "add it or drop --kv-granularity")
        dynamic = config.dynamic
        int8_only = (("--activation", args.activation), ("--granularity", args.granularity),
                     ("--dynamic", args.dynamic), ("--weight-bits", getattr(args, "weight_bits", None)))
        for flag, value in int8_only:
            if value is not None and value is not False:
                raise inputs.UsageError(f"{flag} has no effect with --scheme {scheme} (E4M3 activations, "
                                        f"{'per token at run time' if dynamic else 'static per tensor'}); drop it")
        if args.weight_observer != "per_channel_minmax":
            raise inputs.UsageError(f"--weight-observer has no effect with --scheme {scheme} (E4M3 weights, "
                                    "amax / 448 per output channel); drop it")
        if dynamic and args.observer is not None:
            raise inputs.UsageError(f"--observer has no effect with --scheme {scheme} (scales are chosen at run "
                                    "time); drop it")
        ops = tuple(sorted(config.ops))
        if args.ops is not None:
            ops = tuple(sorted({o.strip() for o in args.ops.split(",") if o.strip()}))
        recipe = FP8Recipe(scheme, args.observer or config.act_observer, kv, ops,
                           getattr(args, "algorithm", None) or config.weight_algorithm, kv_granularity or "per-tensor",
                           config.dynamic, config.granularity.value)
        try:
            recipe.quantizer([])
        except ValueError as exc:
            raise inputs.UsageError(str(exc).splitlines()[0].replace("act_observer", "--observer")) from None
        return recipe

    def quantizer(self, skipped: list[str]):
        """FP8 linears/matmuls plus int8 embeddings (as the other recipes); ``skipped`` modules stay float."""
        from torchao.quantization.pt2e.quantizer import ComposableQuantizer

        from quantkit.quantizers import EmbeddingQuantizer

        embeddings = EmbeddingQuantizer()
        for name in skipped:
            embeddings.set_module_name(name, None)
        return ComposableQuantizer([embeddings, self._fp8(skipped)])

    def _fp8(self, skipped: list[str]):
        from quantkit.quantizers import FP8Quantizer

        fp8 = FP8Quantizer(dynamic=self.dynamic, granularity=self.granularity, kv_cache=self.kv_cache,
                           kv_granularity=self.kv_granularity, act_observer=self.observer,
                           ops=frozenset(self.ops), weight_algorithm=self.algorithm)
        for name in skipped:
            fp8.set_module_name(name, None)
        return fp8

    def check_kv_cache(self, gm, skipped: list[str]) -> None:
        """With ``--kv-cache``, refuse a captured model with no attention outside the ``--skip``
        patterns (nothing would be quantized, yet the recipe would say a KV cache is); runs
        before calibration."""
        if self.kv_cache is None:
            return
        if not self._fp8(skipped).kv_cache_sites(gm):
            where = " outside the --skip patterns" if skipped else ""
            raise QuantkitError(f"no attention found{where}: --kv-cache has nothing to quantize (the model has no "
                                "scaled_dot_product_attention and no softmax between two matmuls); drop --kv-cache")

    def config(self) -> FP8Config:
        """This recipe's ``FP8Config`` (what quantization.json's ``config`` records; the KV cache is
        the quantizer's, recorded in ``recipe``)."""
        return self._fp8([]).global_config

    def to_json(self) -> dict:
        dynamic, granularity = self.dynamic, self.granularity
        return {"scheme": self.scheme, "fp8": True, "activation": "float8_e4m3fn", "dynamic": dynamic,
                "granularity": granularity, "ops": list(self.ops), "observer": None if dynamic else self.observer,
                "weights": "float8_e4m3fn per channel", "weight_observer": "per_channel_minmax",
                "kv_cache": self.kv_cache, "kv_granularity": self.kv_granularity if self.kv_cache else None,
                "weight_algorithm": self.algorithm, "embeddings": "int8 per row"}


def describe_fp8(r: dict) -> str:
    """One sentence naming an FP8 recipe (report.md, inspect)."""
    act = ("E4M3 activations per token at run time" if r.get("dynamic")
           else f"static E4M3 activations (observer `{r.get('observer')}`)")
    kv = f", KV cache {r.get('kv_cache')}" if r.get("kv_cache") else ""
    if kv and r.get("kv_granularity") == "per-head":
        kv += " per head"
    rounding = f", {r.get('weight_algorithm')} rounding" if r.get("weight_algorithm") not in (None, "rtn") else ""
    return (f"scheme `{r.get('scheme')}`: E4M3 weights (amax / 448 per channel{rounding}), {act}{kv}, "
            f"ops {', '.join(r.get('ops') or [])}, int8 embeddings")
