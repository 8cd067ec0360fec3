"""FX rewrites of the traced model: fusions and cleanup, registered by name (see `registry`)."""

from atom_compile.passes import (  # noqa: F401
    cleanup,
    final_norm_rows,
    fp8_linear,
    gated_mlp,
    qk_norm_rope_cache,
    qkv_rope_cache,
    rms_norm_linear,
    rms_norm_quant,
    rope_cache,
    silu_mul_linear,
    silu_mul_quant,
)
from atom_compile.passes.registry import (
    DEFAULT_PIPELINE,
    PassRecord,
    PatternPass,
    RegisteredPass,
    get_pass,
    list_passes,
    register_pass,
    resolve_pipeline,
    run_passes,
    unregister_pass,
)

__all__ = [
    "DEFAULT_PIPELINE",
    "PassRecord",
    "PatternPass",
    "RegisteredPass",
    "get_pass",
    "list_passes",
    "register_pass",
    "resolve_pipeline",
    "run_passes",
    "unregister_pass",
]
