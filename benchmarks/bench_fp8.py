"""FP8 on the GPU: small-M GEMMs against the weight-read roofline, and FP8 decode / throughput against bf16.

    python benchmarks/bench_fp8.py --stages gemm                        # Llama-3-8B linear shapes, M = 1..64
    python benchmarks/bench_fp8.py --stages gemm --sweep                # also every Triton tile config
    python benchmarks/bench_fp8.py --stages decode --preset llama-3-8b  # bf16 vs FP8 per-channel vs block-128
    python benchmarks/bench_fp8.py --stages offline --offline-prompts 200

gemm: for each Llama-3-8B projection (N x K) and M rows, the median time of bf16 cuBLAS, FP8
cuBLASLt via torch._scaled_mm (row-wise and tensor-wise scales), our Triton tile GEMM and the
skinny decode GEMM (each with 128x128 block scales and per-channel scales; the skinny one for
M <= gemm.SKINNY_MAX_M, where the dispatch picks it; at M = 1 also the fp8_linear ops' weight-only
GEMV of a bf16 x, bare and behind its RMSNorm prologue with and without the residual add), against the
roofline: bytes the GEMM must read and write (FP8 weight, its scales, x and out) over the copy bandwidth
measured in the same run. `--timer graph` (the default) times CUDA-graph replays that call the GEMM once on each of
several weight copies, bench_gemm.MIN_REPLAY_BYTES in all, so the weight streams from HBM with no launch
overhead between calls, as in a decode step; `--timer do_bench` times single calls (L2 flushed).
`--sweep` adds the best tile-kernel config and, for the skinny kernel at `--sweep-ms`, every
config of `bench_gemm.skinny_sweep_configs` next to its default (`gemm.skinny_config`), printed as a second
table (best config per shape, M and layout) and written to the JSON rows as `skinny_{block,channel}_sweep`
(every config's time). decode / offline: artifacts with random weights, exported
bf16, FP8 online per-channel (`--quantization fp8`), FP8 block-128 (a config.json carrying an
fp8 `quantization_config`) and per-channel with an FP8 KV cache (`--kv-cache-dtype fp8`, or
`fp8_per_token_head`), each timed
by `bench_decode.py` / `bench_offline.py` in a subprocess.
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
from bench_common import copy_bandwidth, device_name, print_table, projections, write_json
from bench_gemm import config_name, sweep_skinny, timed

import atom_compile
from atom_models.checkpoints import make_config_only
from atom_models.ops.quant import quant_fp8_per_token_reference, quantize_weight
from atom_models.ops.triton_kernels import gemm

HERE = Path(__file__).resolve().parent
# Llama-3-8B's projections as (name, N, K), qkv and gate_up packed, and up alone
SHAPES = [p for p in projections("llama-3-8b") if p[0] != "lm_head"] + [("up", 14336, 4096)]
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# name -> (config.json overrides, --quantization, --kv-cache-dtype)
VARIANTS = {
    "bf16": ({}, None, "auto"),
    "fp8 per-channel": ({}, "fp8", "auto"),
    "fp8 block-128": ({"quantization_config": BLOCK_FP8}, None, "auto"),
    "fp8 + fp8 KV": ({}, "fp8", "fp8"),
    "fp8 + fp8 KV per token-head": ({}, "fp8", "fp8_per_token_head"),
}


def sweep_configs(m: int) -> list[gemm.GemmConfig]:
    block_m = max(16, triton.next_power_of_2(m))
    return [
        gemm.GemmConfig(block_m, block_n, 128, 8, warps, stages)
        for block_n, stages, warps in product((32, 64, 128), (3, 4, 5), (4, 8))
        if warps == 4 or block_n == 128
    ]


def time_shape(name: str, n: int, k: int, m: int, args: argparse.Namespace, bandwidth: float) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x_q, x_scale = quant_fp8_per_token_reference(x)
    x_tensor_scale = x_scale.max().reshape(1)
    w_channel, s_channel = quantize_weight(w, "per_channel")
    w_tensor, s_tensor = quantize_weight(w, "per_tensor")
    w_block, s_block = quantize_weight(w, "block", (128, 128))
    out, timer = torch.bfloat16, args.timer
    # layout -> (weight, its scales, scale block, activation scale groups): the two the tile and skinny kernels
    # are timed on, with activations quantized as the runtime does for each (block: a scale a token and 128 columns)
    layouts = {"block": (w_block, s_block, (128, 128), 128), "channel": (w_channel, s_channel, (1, k), 0)}
    activations = {0: (x_q, x_scale), 128: quant_fp8_per_token_reference(x, 128)}

    def tile(w_, scale, scale_block, group, config=None):
        return gemm.run_scaled_mm(*activations[group], w_, scale, None, out, scale_block, config)

    def skinny(w_, scale, scale_block, group, config=None):
        return gemm.run_skinny_mm(*activations[group], w_, scale, None, out, scale_block, config)

    row = {
        "shape": name,
        "n": n,
        "k": k,
        "m": m,
        "roofline_us": (n * k + m * k + 2 * m * n) / bandwidth * 1e6,
        "bf16_roofline_us": (2 * n * k + 2 * m * k + 2 * m * n) / bandwidth * 1e6,
        "bf16_us": timed(timer, w, partial(F.linear, x)),
        "cublas_rowwise_us": timed(
            timer, w_channel, partial(gemm.cublas_scaled_mm, x_q, x_scale, w_scale=s_channel, out_dtype=out)
        ),
        "cublas_tensorwise_us": timed(
            timer, w_tensor, partial(gemm.cublas_scaled_mm, x_q, x_tensor_scale, w_scale=s_tensor, out_dtype=out)
        ),
    }
    if m == 1:  # the fp8_linear ops' one-token GEMV: x unquantized, per-channel weight scales (weight-only)
        norm_weight, residual = torch.rand(k, device="cuda", dtype=x.dtype) + 0.5, torch.randn_like(x)
        prologues = {  # bare (o_proj, down); RMSNorm (a layer's first); residual add + RMSNorm (qkv, gate_up)
            "weight_only_us": None,
            "weight_only_norm_us": gemm.RMSNormPrologue(norm_weight, 1e-5),
            "weight_only_add_norm_us": gemm.RMSNormPrologue(norm_weight, 1e-5, residual, torch.empty_like(x)),
        }
        for key, prologue in prologues.items():
            row[key] = timed(
                timer,
                w_channel,
                lambda w_, p=prologue: gemm.run_skinny_mm(x, None, w_, s_channel, None, out, (1, k), prologue=p),
            )
    for layout, (weight, scale, scale_block, group) in layouts.items():
        row[f"triton_{layout}_us"] = timed(
            timer, weight, partial(tile, scale=scale, scale_block=scale_block, group=group)
        )
        if m <= gemm.SKINNY_MAX_M:
            run = partial(skinny, scale=scale, scale_block=scale_block, group=group)
            row[f"skinny_{layout}_us"] = timed(timer, weight, run)
            row[f"skinny_{layout}_config"] = config_name(gemm.skinny_config(m, n, k, scale_block[1], weight.device))
            if args.sweep and m in args.sweep_ms:
                row[f"skinny_{layout}_sweep"] = sweep_skinny(timer, weight, run, m, layout == "block")
    # what the dispatch runs: skinny up to SKINNY_MAX_M, then the tile kernel (block) and cuBLASLt (per channel);
    # one token of an FP8 model with per-channel weights runs weight-only (the fp8_linear ops)
    channel = row.get("weight_only_us", row.get("skinny_channel_us", row["cublas_rowwise_us"]))
    row["block_of_roofline"] = row["roofline_us"] / row.get("skinny_block_us", row["triton_block_us"])
    row["channel_of_roofline"] = row["roofline_us"] / channel
    if args.sweep:
        tile_block = partial(tile, scale=s_block, scale_block=(128, 128), group=128)
        best_us, best = min(
            ((timed(timer, w_block, partial(tile_block, config=c)), c) for c in sweep_configs(m)), key=lambda t: t[0]
        )
        row["sweep_best_us"], row["sweep_best_config"] = best_us, asdict(best)
    print(f"{name} {n}x{k} M={m}: roofline {row['roofline_us']:.1f} us, block {row['block_of_roofline']:.2f} of it")
    return row


def export_variants(preset: str, workdir: Path, names: list[str]) -> dict[str, Path]:
    """Random-weight artifacts of `preset`, one a variant of `names`: bf16, FP8 per-channel (online), FP8 block-128
    (an fp8 config.json); variants that differ only in their KV-cache dtype share one."""
    artifacts: dict[tuple, Path] = {}
    for overrides, quantization, _ in (VARIANTS[name] for name in names):
        key = (json.dumps(overrides, sort_keys=True), quantization)
        if key in artifacts:
            continue
        name = f"{quantization or 'none'}-{len(artifacts)}"
        model_dir = make_config_only(workdir / f"{name}-config", preset, **overrides)
        artifacts[key] = workdir / f"{name}-artifact"
        atom_compile.export(
            model_dir, artifacts[key], device="cuda", load_dummy=True, dtype="bfloat16", quantization=quantization
        )
    return {
        name: artifacts[(json.dumps(overrides, sort_keys=True), quantization)]
        for name, (overrides, quantization, _) in ((name, VARIANTS[name]) for name in names)
    }


def run_script(script: str, artifact: Path, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, str(HERE / script), "--artifact", str(artifact), "--out", str(out), *extra]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", default=["gemm", "decode"], choices=["gemm", "decode", "offline"])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="GEMM rows")
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in SHAPES], help="projections to time")
    parser.add_argument("--sweep", action="store_true", help="time every Triton tile config too")
    parser.add_argument(
        "--sweep-ms", type=int, nargs="+", default=[1, 16, 32, 64], help="M of the skinny sweep (one a tile height)"
    )
    parser.add_argument("--timer", choices=["graph", "do_bench"], default="graph")
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--offline-prompts", type=int, default=1000)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="decode, offline")
    parser.add_argument("--out", type=Path, default=Path("bench_fp8.json"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    result: dict = {"copy_bandwidth": bandwidth}
    if "gemm" in args.stages:
        shapes = [shape for shape in SHAPES if shape[0] in args.shapes]
        rows = [time_shape(*shape, m, args, bandwidth) for shape, m in product(shapes, args.ms)]
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
            ("skinny_block_us", "skinny block us", ".1f"),
            ("skinny_channel_us", "skinny chan us", ".1f"),
            ("weight_only_us", "weight-only us", ".1f"),
            ("weight_only_norm_us", "+norm us", ".1f"),
            ("weight_only_add_norm_us", "+add+norm us", ".1f"),
            ("block_of_roofline", "block/roofline", ".2f"),
            ("channel_of_roofline", "chan/roofline", ".2f"),
        ]
        if args.sweep:
            columns.append(("sweep_best_us", "tile sweep best us", ".1f"))
        title = f"FP8 GEMM ({args.timer}), {device_name()}, copy {bandwidth / 1e12:.2f} TB/s"
        print_table(title, rows, columns)
        if args.sweep:
            swept = [
                {
                    "shape": r["shape"],
                    "m": r["m"],
                    "layout": layout,
                    "default_us": r[f"skinny_{layout}_us"],
                    "default_config": r[f"skinny_{layout}_config"],
                    **r[f"skinny_{layout}_sweep"],
                }
                for r in rows
                for layout in ("block", "channel")
                if f"skinny_{layout}_sweep" in r
            ]
            for r in swept:
                r["default_of_best"] = r["best_us"] / r["default_us"]
            print_table(
                f"skinny GEMM sweep ({args.timer}), {device_name()}: default config (gemm.skinny_config) vs best",
                swept,
                [
                    ("shape", "shape", "s"),
                    ("m", "M", "d"),
                    ("layout", "layout".rjust(7), ">7"),
                    ("default_us", "default us", ".1f"),
                    ("default_config", "default config".rjust(32), ">32"),
                    ("best_us", "best us", ".1f"),
                    ("best_config", "best config".rjust(32), ">32"),
                    ("default_of_best", "best/default", ".2f"),
                ],
            )
    if {"decode", "offline"} & set(args.stages):
        with tempfile.TemporaryDirectory() as tmp:
            artifacts = export_variants(args.preset, Path(tmp), args.variants)
            for stage in ("decode", "offline"):
                if stage not in args.stages:
                    continue
                rows = []
                for name, artifact in artifacts.items():
                    out = Path(tmp) / f"{stage}-{name.replace(' ', '-')}.json"
                    kv = ["--kv-cache-dtype", VARIANTS[name][2]]
                    if stage == "decode":
                        extra = ["--batch-sizes", *map(str, args.batch_sizes), *kv]
                        measured = run_script("bench_decode.py", artifact, out, extra)
                        rows += [{"variant": name, **r} for r in measured["rows"]]
                    else:
                        extra = ["--num-prompts", str(args.offline_prompts), *kv]
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
            bf16 = next((row["output_tok_s"] for row in result["offline"] if row["variant"] == "bf16"), None)
            for row in result["offline"]:
                row["vs_bf16"] = row["output_tok_s"] / bf16 if bf16 else float("nan")
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
