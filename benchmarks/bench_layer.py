"""Decode layers in CUDA-graph replays: what each part of a layer costs between its neighbours.

    python benchmarks/bench_layer.py --preset qwen3-0.6b --batch-sizes 1 8 64 256 --context 432
    python benchmarks/bench_layer.py --preset llama-3-8b --quantization fp8 --batch-sizes 1   # FP8 weights

`bench_kernels.py` times each kernel alone, back to back. In a decode step every kernel is launched early
(programmatic dependent launch) and waits for the one before, so what a kernel costs depends on its neighbours: the
twelfth session found a 3-stage decode attention launch losing ~1.2 µs a layer straight after the qkv GEMV, which
no kernel timed alone shows. Each case runs 20 layers in one graph, each with weights and a cache of its own (as a
model's layers: nothing served from L2), through the ops the exported graph runs (after its fusion passes): the
whole decoder layer (`decoder layer`: add + RMSNorm + qkv, the RoPE (QK-norm for Qwen3) cache write — for Llama in
the qkv GEMV's epilogue, `qkv_rope_and_cache` — paged attention, o, then the MLP half in `fused_add_rms_norm_mlp`);
its attention half (`attention half`: qkv to o); the same without the cache write (`attention after the GEMV`); the
qkv and o projections alone (`GEMVs`); µs a layer, and `layer - half` the MLP half. `--quantization fp8` quantizes
the projections per output channel and runs the fp8_linear ops (one token: the weight-only GEMVs), as an artifact
exported with `--quantization fp8` does. A decoder layer here should track a model step's share of it without
exporting an artifact (a scratch version of the case, H100, thirteenth session: ~30 µs a layer at Qwen3-0.6B batch
1, against ~29 in the model's graph profile).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from bench_common import device_name, graph_ms, print_table, served_table_blocks, write_json

from atom_models.checkpoints import PRESETS
from atom_models.ops import set_backend
from atom_models.ops.quant import quantize_weight
from atom_models.ops.rotary import rope_cos_sin_cache, rope_inv_freq

BLOCK_SIZE = 16
REPEATS = 20


def layer_cases(preset: dict, batch: int, context: int, fp8: bool) -> dict[str, Callable]:
    """One layer's cases over random weights and a paged cache holding `context` tokens a sequence; `fp8`: the
    projections' weights quantized per output channel, run by the fp8_linear ops (as `--quantization fp8`)."""
    dtype, device = torch.bfloat16, torch.device("cuda")
    q_heads, kv_heads, hidden = preset["num_attention_heads"], preset["num_key_value_heads"], preset["hidden_size"]
    head_dim = preset.get("head_dim", hidden // q_heads)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    cache = torch.randn(2, batch * blocks_per_seq, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.zeros(batch, served_table_blocks(batch, context, BLOCK_SIZE), dtype=torch.int32, device=device)
    tables[:, :blocks_per_seq] = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    cos_sin = rope_cos_sin_cache(rope_inv_freq(head_dim, preset.get("rope_theta", 1e4), None), context).to(device)
    w_qkv = torch.randn((q_heads + 2 * kv_heads) * head_dim, hidden, device=device, dtype=dtype) / hidden**0.5
    w_o = torch.randn(hidden, q_heads * head_dim, device=device, dtype=dtype) / (q_heads * head_dim) ** 0.5
    inter = preset["intermediate_size"]
    w_gate_up = torch.randn(2 * inter, hidden, device=device, dtype=dtype) / hidden**0.5
    w_down = torch.randn(hidden, inter, device=device, dtype=dtype) / inter**0.5
    input_norm, post_norm = (torch.rand(hidden, device=device, dtype=dtype) + 0.5 for _ in range(2))
    x, residual = (torch.randn(batch, hidden, device=device, dtype=dtype) for _ in range(2))
    norms = (torch.rand(head_dim, device=device, dtype=dtype) + 0.5,) * 2 if preset["model_type"] == "qwen3" else None
    scale, eps = head_dim**-0.5, 1e-6
    ops = torch.ops.atom
    if fp8:
        w_qkv, w_o, w_gate_up, w_down = (quantize_weight(w, "per_channel") for w in (w_qkv, w_o, w_gate_up, w_down))

    def linear(x, w):
        return ops.fp8_linear(x, *w, None, dtype) if fp8 else ops.linear(x, w, None)

    def norm_linear(x, residual, norm, w):
        if fp8:
            return ops.fused_add_rms_norm_fp8_linear(x, residual, norm, eps, *w, None, dtype)
        return ops.fused_add_rms_norm_linear(x, residual, norm, eps, w, None)

    def mlp(x, residual):
        (w1, s1), (w2, s2) = (w_gate_up, w_down) if fp8 else ((w_gate_up, None), (w_down, None))
        return ops.fused_add_rms_norm_mlp(x, residual, post_norm, eps, w1, s1, None, w2, s2, None, dtype)[0]

    def qkv():
        h, summed = norm_linear(x, residual, input_norm, w_qkv)
        q, k, v = h.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = q.view(batch, q_heads, head_dim), k.view(batch, kv_heads, head_dim), v.view(batch, kv_heads, head_dim)
        return q, k, v, summed

    def attend(q):
        return linear(ops.paged_attention(q, cache, tables, seq_lens, query_start_loc, scale).flatten(1), w_o)

    def attention_half():
        if norms is None:  # Llama: the qkv GEMV rotates and writes the cache in its epilogue (pass `qkv_rope_cache`)
            (w, w_scale), out_dtype = (w_qkv if fp8 else (w_qkv, None)), (dtype if fp8 else None)
            front = (x, residual, input_norm, eps, w, w_scale, None, out_dtype, positions, cos_sin, cache, slots)
            q, summed = ops.qkv_rope_and_cache(*front, q_heads)
        else:
            q, k, v, summed = qkv()
            q = ops.qk_norm_rope_and_cache(positions, q, k, v, *norms, eps, cos_sin, cache, slots)
        return attend(q), summed

    def decoder_layer():
        o, summed = attention_half()
        return mlp(o, summed)

    return {
        "decoder_layer_us": decoder_layer,
        "attention_half_us": attention_half,
        "attention_after_gemv_us": lambda: attend(qkv()[0]),
        "gemvs_us": lambda: linear(qkv()[0].flatten(1), w_o),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=432, help="tokens cached a sequence, the new one included")
    parser.add_argument("--quantization", choices=["fp8"], help="FP8 weights, per output channel")
    parser.add_argument("--out", type=Path, default=Path("bench_layer.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer needs a CUDA device")
    if args.context < 1:
        parser.error(f"--context must be at least 1, got {args.context}")
    set_backend("triton")
    fp8 = args.quantization == "fp8"
    rows = []
    for batch in args.batch_sizes:
        # Each replayed layer has weights and a cache of its own, as a model's layers do: none is served from L2.
        layers = [layer_cases(PRESETS[args.preset], batch, args.context, fp8) for _ in range(REPEATS)]
        row = {"batch": batch, "context": args.context}
        row |= {name: graph_ms([cases[name] for cases in layers]) * 1e3 for name in layers[0]}
        del layers
        row["attention_us"] = row["attention_half_us"] - row["gemvs_us"]
        row["mlp_half_us"] = row["decoder_layer_us"] - row["attention_half_us"]
        rows.append(row)
    print_table(
        f"decode layers, {args.preset} shapes{', FP8 weights' * fp8}, {device_name()}, µs a layer (graph of {REPEATS})",
        rows,
        [
            ("batch", "batch", "d"),
            ("context", "context", "d"),
            ("decoder_layer_us", "decoder layer", ".2f"),
            ("attention_half_us", "attention half", ".2f"),
            ("attention_after_gemv_us", "attn after GEMV", ".2f"),
            ("gemvs_us", "GEMVs", ".2f"),
            ("attention_us", "half - GEMVs", ".2f"),
            ("mlp_half_us", "layer - half", ".2f"),
        ],
    )
    write_json(args.out, {"preset": args.preset, "quantization": args.quantization, "rows": rows})


if __name__ == "__main__":
    main()
