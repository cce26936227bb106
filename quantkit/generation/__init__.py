"""Text generation with a program that holds a static KV cache (``quantkit.capture(..., max_cache_len=N)``).

Owns the decode loop (:func:`generate`: one prefill call, then one call per token, stopping at
eos), the choice of the next token outside the graph (``_sampling``: greedy, temperature, top-k,
top-p) and the compiled programs it reuses. It sits at the accuracy/export level: it uses
lowering (``quantkit.compile``) and pipeline (the cache record), never the façade or the CLI.
``quantkit.generate`` re-exports :func:`generate`.
"""

from ._generate import GenerationStats, clear_compiled, generate, generate_with_stats, program_cache_info
from ._sampling import GenerationError, SamplingConfig, next_tokens, top_k_filter, top_p_filter

__all__ = ["generate", "generate_with_stats", "GenerationStats", "GenerationError", "SamplingConfig",
           "next_tokens", "top_k_filter", "top_p_filter", "clear_compiled", "program_cache_info"]
