"""Graph rewrites: the weight probe pass and the custom op it inserts."""

from hostswap.passes import probe_op  # noqa: F401  (registers hostswap::probe)
from hostswap.passes import routed_experts  # noqa: F401  (registers hostswap::routed_experts)
from hostswap.passes import collectives  # noqa: F401  (registers hostswap::all_reduce and hostswap::all_gather)
from hostswap.passes.lowering import save, to_executorch
from hostswap.passes.quantized_linear import QuantizedLayoutError, prepare_quantized
from hostswap.passes.weight_offload import (
    WeightOffloadError,
    WeightOffloadPass,
    apply_weight_offload,
    get_weight_schedule,
)

__all__ = ["QuantizedLayoutError", "prepare_quantized", "WeightOffloadError", "WeightOffloadPass", "apply_weight_offload", "get_weight_schedule", "save", "to_executorch"]
