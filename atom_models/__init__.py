"""Model definitions (one file per family), their layers, and the ops library beneath them."""

__version__ = "0.1.0"

from atom_models import ops  # noqa: F401  (registers torch.ops.atom.*)
from atom_models.layers import AttentionMetadata
from atom_models.loader import (
    WeightLoadError,
    load_config,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from atom_models.registry import MODEL_REGISTRY, UnsupportedModelError, model_class_for

__all__ = [
    "MODEL_REGISTRY",
    "AttentionMetadata",
    "UnsupportedModelError",
    "WeightLoadError",
    "load_config",
    "load_model",
    "model_class_for",
    "resolve_device",
    "resolve_dtype",
    "resolve_max_model_len",
]
