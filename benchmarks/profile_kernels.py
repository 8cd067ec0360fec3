"""One launch of a kernel case for Nsight Compute: where a decode kernel's time goes, from hardware counters.

    python benchmarks/profile_kernels.py --list
    ncu --clock-control none --set full -k regex:_attention_kernel --launch-skip 1 --launch-count 1 \
        python benchmarks/profile_kernels.py decode-b1-ctx4096

Each case launches its kernel twice (the first compiles it), so `--launch-skip 1 --launch-count 1` profiles a warm
launch. `bench_kernels.py` and `bench_gemm.py` time the same shapes; this only runs them, once, for the profiler.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from bench_kernels import paged_batch, to_fp8_cache

from atom_models.ops.quant import quantize_weight
from atom_models.ops.triton_kernels import attention, gemm

DTYPE = torch.bfloat16


def decode_attention(batch: int, context: int, fp8_kv: bool = False, **config):
    """Decode over a paged cache: bf16, or FP8 with per-tensor scales (`--kv-cache-dtype fp8`)."""
    q, cache, tables, seq_lens, qsl = paged_batch([1] * batch, [context] * batch)
    scales = ()
    if fp8_kv:
        cache, *scales = to_fp8_cache(cache)
    base = replace(attention.default_config(q.shape[-1]), **config)
    return lambda: attention.run_paged_attention(q, cache, tables, seq_lens, qsl, q.shape[-1] ** -0.5, base, *scales)


def gemv(n: int, k: int, prologue: str | None, fp8: bool = False):
    """One token through an [n, k] weight (bf16, or fp8 with per-row scales: the weight-only path of an FP8
    checkpoint), with the prologue the decode graph fuses in front of it."""
    w = torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5
    w_scale = None
    if fp8:
        w, w_scale = quantize_weight(w, "per_channel")
    x = torch.randn(1, 2 * k if prologue == "silu_mul" else k, device="cuda", dtype=DTYPE)
    if prologue == "silu_mul":
        chosen = gemm.SiluMulPrologue()
    elif prologue == "rms_norm":
        residual, summed = torch.randn_like(x), torch.empty_like(x)
        chosen = gemm.RMSNormPrologue(torch.ones(k, device="cuda", dtype=DTYPE), 1e-6, residual, summed)
    else:
        chosen = None
    return lambda: gemm.run_skinny_mm(x, None, w, w_scale, None, DTYPE, (1, k), prologue=chosen)


CASES = {
    "decode-b1-ctx4096": lambda: decode_attention(1, 4096),
    "decode-b1-ctx4096-1wave": lambda: decode_attention(1, 4096, lone_decode_waves=1),
    "decode-b1-ctx432": lambda: decode_attention(1, 432),
    "decode-b64-ctx2048": lambda: decode_attention(64, 2048),
    "decode-b64-ctx2048-128keys": lambda: decode_attention(64, 2048, unsplit_block_n=128),
    "decode-b64-ctx2048-fp8kv": lambda: decode_attention(64, 2048, fp8_kv=True),
    # Qwen3-0.6B's MLP at batch 1: gate_up after the residual add and norm, down after SiLU·mul.
    "gemv-qwen3-0.6b-gate_up": lambda: gemv(6144, 1024, "rms_norm"),
    "gemv-qwen3-0.6b-down": lambda: gemv(1024, 3072, "silu_mul"),
    # Llama-3-8B FP8 (per-channel) at batch 1, each projection after its prologue.
    "gemv-fp8-llama-3-8b-qkv": lambda: gemv(6144, 4096, "rms_norm", fp8=True),
    "gemv-fp8-llama-3-8b-o": lambda: gemv(4096, 4096, None, fp8=True),
    "gemv-fp8-llama-3-8b-gate_up": lambda: gemv(28672, 4096, "rms_norm", fp8=True),
    "gemv-fp8-llama-3-8b-down": lambda: gemv(4096, 14336, "silu_mul", fp8=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", choices=sorted(CASES))
    parser.add_argument("--list", action="store_true", help="print the cases")
    args = parser.parse_args()
    if args.list or args.case is None:
        print("\n".join(CASES))
        return
    torch.manual_seed(0)
    launch = CASES[args.case]()
    for _ in range(2):
        launch()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
