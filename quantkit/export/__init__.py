"""Saving and loading quantized artifacts: the on-disk format (``_artifact``), verified loading of
``.pt2`` programs without unpickling (``_safe_pt2``), and atomic directory writes (``_atomic``).

``quantkit.save`` / ``quantkit.load`` are the public entry points.
"""

__all__: list[str] = []
