"""HF `architectures` names -> atom model classes."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from atom_models.llama import LlamaForCausalLM
from atom_models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


class UnsupportedModelError(ValueError):
    pass


def model_class_for(config: PretrainedConfig) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise UnsupportedModelError(
        f"unsupported architecture {', '.join(architectures) or '(none given in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
