"""Decode-sized bf16 GEMMs (`linear`) against the weight-read roofline: cuBLAS next to the skinny Triton kernel.

    python benchmarks/bench_gemm.py                        # Llama-3-8B and Qwen3-0.6B projections, M = 1..64
    python benchmarks/bench_gemm.py --sweep --sweep-ms 1 16 32 64

For each projection of each preset (qkv, o, gate_up, down, lm_head; N x K) and M rows: the time of
F.linear (cuBLAS), of the skinny kernel at its default launch (`gemm.skinny_config`), and of what
the triton `linear` dispatches to (the skinny kernel up to `gemm.SKINNY_LINEAR_MAX_M`, then cuBLAS),
against the roofline: bytes read and written (weight, x, out) over the copy bandwidth measured in the
same run. For the projections a decoder layer feeds from a residual-add + RMSNorm (qkv, gate_up) or a
SiLU·mul (down): that op and the `linear` after it (`unfused`) next to the fused linear the passes emit.
`--timer graph` (the default) times CUDA-graph replays over weight copies that together
exceed L2, as in a decode step; `--timer do_bench` single calls. `--sweep` adds every skinny config
(`skinny_sweep_configs`) at `--sweep-ms`. Prints tables and writes JSON. The helpers here also time
bench_fp8.py's FP8 GEMMs.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from functools import partial
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_common import (
    copy_bandwidth,
    device_name,
    graph_ms,
    median_ms,
    print_table,
    projections,
    write_json,
)
from triton.runtime.errors import OutOfResources

from atom_models.ops.triton_kernels import gemm
from atom_models.ops.triton_kernels.activation import silu_and_mul
from atom_models.ops.triton_kernels.norm import fused_add_rms_norm

# Graph replays read at least this many bytes of weight copies, so L2 (50 MB on H100) serves none of them.
MIN_REPLAY_BYTES = 256 * 2**20


def timed(timer: str, weight: torch.Tensor, call) -> float:
    """Microseconds of `call(weight)`: graph replays over copies of the weight, or do_bench of one call."""
    if timer == "do_bench":
        return median_ms(partial(call, weight), 25, 100) * 1e3
    copies = [weight] + [weight.clone() for _ in range(triton.cdiv(MIN_REPLAY_BYTES, weight.nbytes) - 1)]
    return graph_ms([partial(call, copy) for copy in copies], 5, 20) * 1e3


def skinny_sweep_configs(m: int, block: bool, n: int, k: int, weight_bytes: int = 1) -> list[gemm.SkinnyConfig]:
    """The one-token GEMV's tiles (M = 1, per-row or no scales), and the MMA's tile widths, K tiles, splits, depths.

    K tiles are in weight bytes (512 bytes: 512 fp8 or 256 bf16 columns); block scales cap them at 128 columns.
    A small weight's GEMV (loaded before its PDL wait) takes K slices of one tile (weight first) of 1 to 8 rows instead.
    """
    if n * k * weight_bytes <= gemm.GEMV_WEIGHT_FIRST_MAX_BYTES:
        widths = [1 << e for e in range(10, triton.next_power_of_2(k).bit_length())] or [triton.next_power_of_2(k)]
        gemv = [
            gemm.SkinnyConfig(block_n, block_k, triton.cdiv(k, block_k), warps, 1, False)
            for block_n, block_k, warps in product((1, 2, 4, 8), widths, (4, 8))
            if block_n * block_k * weight_bytes <= 64 << 10
        ]
    else:
        gemv = [
            gemm.SkinnyConfig(block_n, block_bytes // weight_bytes, split_k, warps, stages, False)
            for block_n, block_bytes, split_k, warps, stages in product((4, 8, 16), (512, 1024), (1, 2), (2, 4), (2, 4))
        ]
    mma = [
        gemm.SkinnyConfig(block_n, block_k, split_k, 4, stages, True)
        for block_n, block_k, split_k, stages in product(
            (64, 128), (128,) if block else (256 // weight_bytes, 512 // weight_bytes), (1, 2, 4, 8), (4, 5, 6)
        )
    ]
    return gemv if m == 1 and not block else mma  # at M = 1 the GEMV beat every MMA config


def config_name(config: gemm.SkinnyConfig) -> str:
    kind = "mma" if config.dot else "gemv"
    return f"{kind} n{config.block_n} k{config.block_k} split{config.split_k} w{config.num_warps} s{config.num_stages}"


def sweep_skinny(timer: str, weight: torch.Tensor, run, m: int, block: bool) -> dict:
    """Every skinny config (that fits in shared memory) for one weight layout, best first."""
    results = []
    for config in skinny_sweep_configs(m, block, *weight.shape, weight.element_size()):
        try:
            results.append((timed(timer, weight, partial(run, config=config)), config))
        except OutOfResources:
            continue
    results.sort(key=lambda t: t[0])
    return {
        "best_us": results[0][0],
        "best_config": config_name(results[0][1]),
        "all": [{"us": us, **asdict(config)} for us, config in results],
    }


# The op in front of each projection in a decoder layer, as the linear fusions see it.
FUSED_PROLOGUE = {"qkv": "add_rms_norm", "gate_up": "add_rms_norm", "down": "silu_mul"}


def fused_and_unfused(name: str, m: int, k: int) -> tuple:
    """(fused, unfused) callables of a weight for the projection `name`'s fused linear, on random inputs."""
    if FUSED_PROLOGUE[name] == "silu_mul":
        x = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        return partial(gemm.silu_and_mul_linear, x, bias=None), lambda w: gemm.linear(silu_and_mul(x), w, None)
    x, residual = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = torch.ones(k, device="cuda", dtype=torch.bfloat16)

    def unfused(w):
        normed, _ = fused_add_rms_norm(x, residual, g, 1e-6)
        return gemm.linear(normed, w, None)

    return lambda w: gemm.fused_add_rms_norm_linear(x, residual, g, 1e-6, w, None), unfused


def time_shape(preset: str, name: str, n: int, k: int, m: int, args: argparse.Namespace, bandwidth: float) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02

    def skinny(w_, config=None):
        return gemm.run_skinny_mm(x, None, w_, None, None, torch.bfloat16, (1, k), config)

    row = {
        "preset": preset,
        "shape": name,
        "n": n,
        "k": k,
        "m": m,
        "roofline_us": 2 * (n * k + m * k + m * n) / bandwidth * 1e6,
        "cublas_us": timed(args.timer, w, partial(F.linear, x)),
        "linear_us": timed(args.timer, w, partial(gemm.linear, x, bias=None)),
    }
    if m <= gemm.SKINNY_MAX_M:
        row["skinny_us"] = timed(args.timer, w, skinny)
        row["skinny_config"] = config_name(gemm.skinny_config(m, n, k, k, w.device, w.element_size()))
        if args.sweep and m in args.sweep_ms:
            row["sweep"] = sweep_skinny(args.timer, w, skinny, m, False)
            row["sweep_best_us"] = row["sweep"]["best_us"]
            row["sweep_best_config"] = row["sweep"]["best_config"]
    if name in FUSED_PROLOGUE:
        fused, unfused = fused_and_unfused(name, m, k)
        row["fused_us"], row["unfused_us"] = timed(args.timer, w, fused), timed(args.timer, w, unfused)
    row["cublas_of_roofline"] = row["roofline_us"] / row["cublas_us"]
    row["linear_of_roofline"] = row["roofline_us"] / row["linear_us"]
    print(f"{preset} {name} {n}x{k} M={m}: cuBLAS {row['cublas_us']:.1f} us, linear {row['linear_us']:.1f} us")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["llama-3-8b", "qwen3-0.6b"])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="GEMM rows")
    parser.add_argument("--sweep", action="store_true", help="time every skinny config too")
    parser.add_argument("--sweep-ms", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--timer", choices=["graph", "do_bench"], default="graph")
    parser.add_argument("--out", type=Path, default=Path("bench_gemm.json"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rows = [
        time_shape(preset, *shape, m, args, bandwidth)
        for preset in args.presets
        for shape, m in product(projections(preset), args.ms)
    ]
    columns = [
        ("preset", "preset".rjust(11), ">11"),
        ("shape", "shape".rjust(7), ">7"),
        ("m", "M", "d"),
        ("roofline_us", "roofline us", ".1f"),
        ("cublas_us", "cuBLAS us", ".1f"),
        ("skinny_us", "skinny us", ".1f"),
        ("linear_us", "linear us", ".1f"),
        ("unfused_us", "unfused us", ".1f"),
        ("fused_us", "fused us", ".1f"),
        ("cublas_of_roofline", "cuBLAS/roof", ".2f"),
        ("linear_of_roofline", "linear/roof", ".2f"),
    ]
    if args.sweep:
        columns += [("sweep_best_us", "best us", ".1f"), ("sweep_best_config", "best config".rjust(30), ">30")]
    title = f"bf16 GEMM ({args.timer}), {device_name()}, copy {bandwidth / 1e12:.2f} TB/s"
    print_table(title, rows, columns)
    write_json(args.out, {"copy_bandwidth": bandwidth, "skinny_linear_max_m": gemm.SKINNY_LINEAR_MAX_M, "rows": rows})


if __name__ == "__main__":
    main()
