"""quantkit.kernels: int8 compute kernels (Triton on CUDA, ``torch._int_mm`` on CPU).

Each kernel is a ``torch.library`` op (``torch.ops.quantkit.*``) with a fake implementation,
so ``torch.compile`` and Inductor see it: ``int8_linear`` (int8 GEMM with fused
scale / zero point / bias / activation / requantize epilogue), ``int8_bmm`` (its batched
variant for attention), ``quantize_per_token`` (fused dynamic quantization), ``w4a16_linear``
(int4 weight-only) and ``fp8_linear`` (E4M3 x E4M3 GEMM, scales in the epilogue); on CPU,
``int4_linear_cpu`` (int4 weight-only, AVX512-VNNI C++ built with Inductor's compiler into quantkit's
own kernel cache and loaded after a digest check: ``_kernel_cache.py``; ``int4_cpu_status()`` says
whether it runs here and why not); ``sdpa_prefill_bf16`` (attention in bf16 for prompts, float32
for decode steps).
"""

from ._fp8_gemm import FP8_OUT_DTYPES, fp8_linear
from ._kernel_cache import KernelStatus
from ._int4_cpu import available as int4_cpu_available
from ._int4_cpu import status as int4_cpu_status
from ._int4_cpu import int4_linear_cpu, pack_int4_cpu
from ._per_token_quant_cpu import per_token_quant_cpu
from ._prefill_sdpa import sdpa_prefill_bf16
from ._int8_gemm import ACTIVATIONS, OUT_DTYPES, int8_bmm, int8_linear
from ._quant import DECOMPOSED, quantize_per_token
from ._w4a16 import w4a16_linear

__all__ = ["int8_linear", "w4a16_linear", "int4_linear_cpu", "pack_int4_cpu", "per_token_quant_cpu", "sdpa_prefill_bf16", "int4_cpu_available", "int4_cpu_status", "KernelStatus", "fp8_linear", "FP8_OUT_DTYPES", "int8_bmm", "quantize_per_token", "DECOMPOSED", "ACTIVATIONS", "OUT_DTYPES"]
