"""Saving and loading quantized artifacts: the on-disk format (``_artifact``), verified loading of
``.pt2`` programs without unpickling (``_safe_pt2``), atomic directory writes (``_atomic``), and the
engine formats: compressed-tensors (``_compressed_tensors``, vLLM/transformers) and GGUF (``_gguf``,
llama.cpp).

``quantkit.save`` / ``quantkit.load``, ``quantkit.export_compressed_tensors`` and
``quantkit.export_gguf`` are the public entry points.
"""

__all__: list[str] = []
