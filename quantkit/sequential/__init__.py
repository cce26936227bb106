"""Block-by-block quantization of checkpoints larger than memory (``quantkit.quantize_pretrained``).

Sits above ``pipeline``, ``accuracy`` and ``export``, and uses all three:

- ``_run``: :func:`quantize_pretrained` and the block-by-block run (capture without weights,
  one block's weights in memory at a time, convert, streamed export);
- ``_budget``: the measured memory plan that chooses the path;
- ``_state`` / ``_files``: the resumable progress directory (activation cache, digests, marker);
- ``_groupwise``: group-wise weight-only weights folded one at a time;
- ``_gptq``: GPTQ's rounded stream, registered as the run's ``after_block`` calibration hook.
"""

from ._run import parse_size, quantize_pretrained

__all__ = ["quantize_pretrained", "parse_size"]
