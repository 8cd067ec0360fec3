"""FP8 quantization: which layers are quantized and how (`config`), and FP8 checkpoints in HF formats (`checkpoint`)."""

from atom_models.quantization.config import LayerQuantConfig, QuantConfigError, QuantizationConfig

__all__ = ["LayerQuantConfig", "QuantConfigError", "QuantizationConfig"]
