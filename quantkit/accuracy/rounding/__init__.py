"""Weight rounding algorithms, registered as calibration hooks (``quantkit.pipeline._hooks``).

A weight observer that declares ``weight_algorithm`` ``"gptq"`` or ``"awq"`` (set by
``WeightOnlyQuantizer(algorithm=...)`` or ``QuantConfig(weight_algorithm=...)``) asks for its
linear's weight to be rounded by that algorithm instead of to nearest. ``calibrate`` then:

1. runs AWQ (``_awq``, a ``before_pass`` hook: one pass over the data before the usual
   calibration pass, so activation observers see the scaled activations): per input channel
   scales folded into the preceding norm/linear or kept as an explicit ``mul``;
2. runs the usual calibration pass;
3. runs GPTQ (``_gptq``, an ``after_pass`` hook) transformer block by transformer block in
   graph order, with the blocks before it already rounded.

Modules: ``_base`` (the linears to round, the observer-free tapped graph, the plan both hooks
share), ``_awq``, ``_gptq`` and ``_gptq_blocks`` (GPTQ over the chain of blocks, also used by the
block-by-block run), ``_sync`` (their statistics under a ``torch.distributed`` process group).
Importing this package registers the hooks; ``quantkit.accuracy`` imports it.
"""

from ._awq import AWQConfig, awq_hook
from ._base import ROUNDING_META_KEY, find_rounded_linears, pending_algorithms
from ._gptq import gptq_hook

__all__ = ["AWQConfig", "ROUNDING_META_KEY", "find_rounded_linears", "pending_algorithms", "awq_hook", "gptq_hook"]
