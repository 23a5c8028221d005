"""hostswap: run PyTorch programs in less GPU memory than their tensors need."""

from hostswap import schedules
from hostswap.passes import QuantizedLayoutError, WeightOffloadError, apply_weight_offload, get_weight_schedule, prepare_quantized, save, to_executorch
from hostswap.passes.activation_offload import ActivationOffloadError, OffloadCoverageWarning, activation_offload_backend
from hostswap.passes.out_variants import OutVariantError
from hostswap.runtime.activation_offload import mark_not_offload
from hostswap.schedules.artifacts import ArtifactError

__all__ = ["ActivationOffloadError", "ArtifactError", "QuantizedLayoutError", "prepare_quantized", "OffloadCoverageWarning", "OutVariantError", "activation_offload_backend", "mark_not_offload", "WeightOffloadError", "apply_weight_offload", "get_weight_schedule", "save", "schedules", "to_executorch", "runtime", "llm", "optim", "activations", "fsdp_quants"]


def __getattr__(name):
    # The runtime (and generation, which uses it) pulls in more of ExecuTorch and CUDA
    # bindings; load them when first asked for.
    if name in ("runtime", "llm", "optim", "activations", "fsdp_quants"):
        import importlib

        return importlib.import_module(f"hostswap.{name}")
    raise AttributeError(f"module 'hostswap' has no attribute {name!r}")
