"""FP8 on the GPU: small-M GEMMs against the weight-read roofline, and FP8 decode / throughput against bf16.

    python benchmarks/bench_fp8.py --stages gemm                        # Llama-3-8B linear shapes, M = 1..64
    python benchmarks/bench_fp8.py --stages gemm --sweep                # also every Triton tile config
    python benchmarks/bench_fp8.py --stages decode --preset llama-3-8b  # bf16 vs FP8 per-channel vs block-128
    python benchmarks/bench_fp8.py --stages offline --offline-prompts 200

gemm: for each Llama-3-8B projection (N x K) and M rows, the median time (triton.testing.do_bench,
L2 cleared between runs) of bf16 cuBLAS, FP8 cuBLASLt via torch._scaled_mm (row-wise and
tensor-wise scales), and our Triton GEMM (128x128 block scales, and per-channel scales), against
the roofline: bytes the GEMM must read and write (FP8 weight, its scales, x and out) over the
copy bandwidth measured in the same run. decode / offline: artifacts with random weights, exported
bf16, FP8 online per-channel (`--quantization fp8`) and FP8 block-128 (a config.json carrying an
fp8 `quantization_config`), each timed by `bench_decode.py` / `bench_offline.py` in a subprocess.
Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from functools import partial
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_common import copy_bandwidth, device_name, print_table, write_json

import atom_compile
from atom_models.checkpoints import make_config_only
from atom_models.ops.quant import quant_fp8_per_token_reference, quantize_weight
from atom_models.ops.triton_kernels import gemm

HERE = Path(__file__).resolve().parent
# Llama-3-8B's projections as (name, N, K); gate_up and qkv are packed.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("up", 14336, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
VARIANTS = {
    "bf16": ({}, None),
    "fp8 per-channel": ({}, "fp8"),
    "fp8 block-128": ({"quantization_config": BLOCK_FP8}, None),
}


def median_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def sweep_configs(m: int) -> list[gemm.GemmConfig]:
    block_m = max(16, triton.next_power_of_2(m))
    return [
        gemm.GemmConfig(block_m, block_n, 128, 8, warps, stages)
        for block_n, stages, warps in product((32, 64, 128), (3, 4, 5), (4, 8))
        if warps == 4 or block_n == 128
    ]


def time_shape(name: str, n: int, k: int, m: int, sweep: bool, bandwidth: float) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x_q, x_scale = quant_fp8_per_token_reference(x)
    x_tensor_scale = x_scale.max().reshape(1)
    w_channel, s_channel = quantize_weight(w, "per_channel")
    w_tensor, s_tensor = quantize_weight(w, "per_tensor")
    w_block, s_block = quantize_weight(w, "block", (128, 128))
    out = torch.bfloat16
    block = partial(gemm.run_scaled_mm, x_q, x_scale, w_block, s_block, None, out, (128, 128))
    row = {
        "shape": name,
        "n": n,
        "k": k,
        "m": m,
        "roofline_us": (n * k + m * k + 2 * m * n) / bandwidth * 1e6,
        "bf16_roofline_us": (2 * n * k + 2 * m * k + 2 * m * n) / bandwidth * 1e6,
        "bf16_us": median_us(partial(F.linear, x, w)),
        "cublas_rowwise_us": median_us(partial(gemm.cublas_scaled_mm, x_q, x_scale, w_channel, s_channel, out)),
        "cublas_tensorwise_us": median_us(partial(gemm.cublas_scaled_mm, x_q, x_tensor_scale, w_tensor, s_tensor, out)),
        "triton_block_us": median_us(block),
        "triton_channel_us": median_us(
            partial(gemm.run_scaled_mm, x_q, x_scale, w_channel, s_channel, None, out, (1, k))
        ),
    }
    row["triton_block_of_roofline"] = row["roofline_us"] / row["triton_block_us"]
    if sweep:
        best_us, best = min(((median_us(partial(block, config=c)), c) for c in sweep_configs(m)), key=lambda t: t[0])
        row["sweep_best_us"], row["sweep_best_config"] = best_us, asdict(best)
    print(f"{name} {n}x{k} M={m}: block {row['triton_block_us']:.1f} us, roofline {row['roofline_us']:.1f} us")
    return row


def export_variants(preset: str, workdir: Path) -> dict[str, Path]:
    """Random-weight artifacts of `preset`: bf16, FP8 per-channel (online), FP8 block-128 (fp8 config)."""
    artifacts = {}
    for name, (overrides, quantization) in VARIANTS.items():
        model_dir = make_config_only(workdir / f"{name.replace(' ', '-')}-config", preset, **overrides)
        artifact = workdir / f"{name.replace(' ', '-')}-artifact"
        atom_compile.export(
            model_dir, artifact, device="cuda", load_dummy=True, dtype="bfloat16", quantization=quantization
        )
        artifacts[name] = artifact
    return artifacts


def run_script(script: str, artifact: Path, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, str(HERE / script), "--artifact", str(artifact), "--out", str(out), *extra]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", default=["gemm", "decode"], choices=["gemm", "decode", "offline"])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="GEMM rows")
    parser.add_argument("--sweep", action="store_true", help="time every Triton tile config too")
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--offline-prompts", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("bench_fp8.json"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    result: dict = {"copy_bandwidth": bandwidth}
    if "gemm" in args.stages:
        rows = [time_shape(*shape, m, args.sweep, bandwidth) for shape, m in product(SHAPES, args.ms)]
        result["gemm"] = rows
        columns = [
            ("shape", "shape", "s"),
            ("m", "M", "d"),
            ("roofline_us", "roofline us", ".1f"),
            ("bf16_us", "bf16 us", ".1f"),
            ("cublas_rowwise_us", "cuBLAS row us", ".1f"),
            ("cublas_tensorwise_us", "cuBLAS tensor us", ".1f"),
            ("triton_block_us", "Triton block us", ".1f"),
            ("triton_channel_us", "Triton chan us", ".1f"),
            ("triton_block_of_roofline", "block/roofline", ".2f"),
        ]
        if args.sweep:
            columns.append(("sweep_best_us", "sweep best us", ".1f"))
        print_table(f"FP8 GEMM, {device_name()}, copy {bandwidth / 1e12:.2f} TB/s", rows, columns)
    if {"decode", "offline"} & set(args.stages):
        with tempfile.TemporaryDirectory() as tmp:
            artifacts = export_variants(args.preset, Path(tmp))
            for stage in ("decode", "offline"):
                if stage not in args.stages:
                    continue
                rows = []
                for name, artifact in artifacts.items():
                    out = Path(tmp) / f"{stage}-{name.replace(' ', '-')}.json"
                    if stage == "decode":
                        extra = ["--batch-sizes", *map(str, args.batch_sizes)]
                        measured = run_script("bench_decode.py", artifact, out, extra)
                        rows += [{"variant": name, **r} for r in measured["rows"]]
                    else:
                        extra = ["--num-prompts", str(args.offline_prompts)]
                        rows.append({"variant": name, **run_script("bench_offline.py", artifact, out, extra)})
                result[stage] = rows
        if "decode" in result:
            print_table(
                f"decode, {args.preset}, {device_name()}",
                result["decode"],
                [
                    ("variant", "variant".rjust(16), ">16"),
                    ("batch", "batch", "d"),
                    ("engine_ms", "engine ms", ".3f"),
                    ("graph_ms", "graph ms", ".3f"),
                    ("roofline_ms", "roofline ms", ".3f"),
                    ("fraction_of_roofline", "of roofline", ".2f"),
                ],
            )
        if "offline" in result:
            bf16 = result["offline"][0]["output_tok_s"]
            for row in result["offline"]:
                row["vs_bf16"] = row["output_tok_s"] / bf16
            print_table(
                f"offline, {args.preset}, {args.offline_prompts} prompts, {device_name()}",
                result["offline"],
                [
                    ("variant", "variant".rjust(16), ">16"),
                    ("output_tok_s", "output tok/s", ".0f"),
                    ("total_tok_s", "total tok/s", ".0f"),
                    ("vs_bf16", "vs bf16", ".2f"),
                ],
            )
    write_json(args.out, {"preset": args.preset, **result})


if __name__ == "__main__":
    main()
