"""Triton kernel benchmark: attention against torch SDPA, row kernels against the reference, copy bandwidth.

    python benchmarks/bench_kernels.py [--out bench_kernels.json] [--sweep]

Shapes follow Llama-3-8B attention (GQA 32/8, head_dim 128, bf16). Ours reads K/V from the
paged cache (block_size 16, blocks scattered); SDPA gets contiguous unpaged K/V.
(1) causal prefill TFLOP/s (causal FLOPs: 2 * 2 * b * h * s^2 * d / 2);
(2) decode KV-read TB/s (bytes of K and V of every context token), timed as CUDA-graph replays
    over enough independent caches that no replay is served from L2; with --fp8-kv also from an FP8 cache
    (per-tensor scales, as `--kv-cache-dtype fp8` serves) and one with a scale per token and head
    (`fp8_per_token_head`), whose TB/s count their one-byte entries (not the inline scales);
(3) device-to-device copy bandwidth (bytes read + written), the ceiling for (2) and for the row kernels;
(4) `sample_rows` over Qwen3's 151,936-wide fp32 logits, greedy and drawn, as CUDA-graph replays, against
    torch's argmax and torch's draw (softmax of logits / T, exponential noise, argmax of the ratio).
Times are medians of triton.testing.do_bench on random data. --sweep also times other tile configs.
"""

from __future__ import annotations

import argparse
import math
import platform
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from bench_common import copy_bandwidth, graph_ms, median_ms, served_table_blocks, write_json
from torch.nn.attention import SDPBackend, sdpa_kernel

from atom_models.ops import attention as attention_ops
from atom_models.ops import norm as norm_ops
from atom_models.ops import quant as quant_ops
from atom_models.ops.activation import silu_and_mul_reference
from atom_models.ops.attention import INLINE_SCALE_DTYPE, inline_scale_cache_shape
from atom_models.ops.quant import FP8_DTYPE, FP8_MAX
from atom_models.ops.rotary import rope_cos_sin_cache, rope_inv_freq
from atom_models.ops.triton_kernels import activation, attention, norm, rotary_cache, sampling

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
# Decode replays touch at least this many bytes of KV, over several caches, so L2 (50 MB) can't serve them.
MIN_DECODE_BYTES = 256 * 2**20


def paged_batch(query_lens: list[int], seq_lens: list[int]):
    """q, a random paged cache holding exactly these contexts in scattered blocks, and the metadata (block tables
    as wide as the engine's decode graphs pass them)."""
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    cache = torch.randn(2, sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    order = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
    columns = served_table_blocks(len(seq_lens), max(seq_lens), BLOCK_SIZE)
    tables = torch.zeros(len(seq_lens), columns, dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start : start + n]
        start += n
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(query_lens), Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), qsl


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backend: SDPBackend):
    """SDPA on [b, h, s, d] tensors, with native GQA where the backend takes it, else K/V expanded.

    Returns (call, kv_expanded)."""

    def run(kk, vv, gqa):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)

    try:
        run(k, v, True)
        return (lambda: run(k, v, True)), False
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        run(k, v, False)
        return (lambda: run(k, v, False)), True


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged cache's keys and values of every sequence as [b, kv_heads, seq, d], for SDPA."""
    rows = tables[:, : -(-seq // cache.shape[2])].long()  # the tables' columns that hold the context
    k, v = (c[rows].flatten(1, 2)[:, :seq].transpose(1, 2).contiguous() for c in cache)
    return k, v


def bench_prefill(batch: int, seq: int, configs: list[attention.AttentionConfig], check: bool) -> list[dict]:
    """Causal prefill of `batch` fresh sequences; with `check`, every output against the reference."""
    flops = 4 * batch * Q_HEADS * seq * seq * HEAD_DIM / 2
    rows = []
    q, cache, tables, seq_lens, qsl = paged_batch([seq] * batch, [seq] * batch)
    scale = HEAD_DIM**-0.5
    ref = attention_ops.paged_attention_reference(q, cache, tables, seq_lens, qsl, scale) if check else None
    for config in configs:
        call = partial(attention.run_paged_attention, q, cache, tables, seq_lens, qsl, scale, config)
        row = dict(kernel="ours (paged)", config=asdict(config))
        if check:
            row["rel_err"] = rel_err(call(), ref)
        ms = median_ms(call)
        rows.append(dict(row, ms=ms, tflops=flops / ms / 1e9))
    qb = q.view(batch, seq, Q_HEADS, HEAD_DIM).transpose(1, 2)
    kb, vb = contiguous_kv(cache, tables, seq)
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            call, expanded = sdpa_call(qb, kb, vb, True, backend)
        except RuntimeError as exc:
            rows.append(dict(kernel=name, error=str(exc).splitlines()[0]))
            continue
        row = dict(kernel=name + (" (K/V expanded)" if expanded else ""))
        if check:
            row["rel_err"] = rel_err(call().transpose(1, 2).reshape(q.shape), ref)
        ms = median_ms(call)
        rows.append(dict(row, ms=ms, tflops=flops / ms / 1e9))
    for row in rows:
        row.update(case=f"prefill {batch}x{seq}")
    return rows


def to_fp8_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cache in e4m3 with a per-tensor scale for K and one for V, and the scales."""
    k_scale, v_scale = (c.abs().amax().float().reshape(1) / FP8_MAX for c in cache)
    return torch.stack([cache[0] / k_scale, cache[1] / v_scale]).to(FP8_DTYPE), k_scale, v_scale


def to_inline_scale_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache in e4m3 with a scale per (token, head) inline (`--kv-cache-dtype fp8_per_token_head`), written by
    the reference cache write."""
    _, blocks, block_size, heads, head_dim = cache.shape
    inline = torch.zeros(
        inline_scale_cache_shape(blocks, block_size, heads, head_dim), dtype=INLINE_SCALE_DTYPE, device=cache.device
    )
    slots = torch.arange(blocks * block_size, device=cache.device)
    attention_ops.reshape_and_cache_reference(cache[0].flatten(0, 1), cache[1].flatten(0, 1), inline, slots)
    return inline


def bench_decode(
    seq_lens: list[int],
    label: str,
    configs: list[attention.AttentionConfig],
    sdpa: bool,
    fp8_kv: bool = False,
    query_lens: list[int] | None = None,
) -> list[dict]:
    """One query token per sequence, or `query_lens` (a mixed step: prefill chunks among the decodes, their context
    counted once in the KV read); each of our outputs is checked against the reference first."""
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * 2
    sets = max(1, math.ceil(MIN_DECODE_BYTES / kv_bytes))
    batches = [paged_batch(query_lens or [1] * len(seq_lens), seq_lens) for _ in range(sets)]
    scale = HEAD_DIM**-0.5
    ref = attention_ops.paged_attention_reference(*batches[0], scale)
    caches = {"ours (paged)": (batches, (), kv_bytes)}
    if fp8_kv:
        fp8_batches, fp8_scales = [], []
        for q, cache, *meta in batches:
            cache8, k_scale, v_scale = to_fp8_cache(cache)
            fp8_batches.append((q, cache8, *meta))
            fp8_scales.append((k_scale, v_scale))
        caches["ours (paged, fp8 KV)"] = (fp8_batches, fp8_scales, kv_bytes // 2)
        inline_batches = [(q, to_inline_scale_cache(cache), *meta) for q, cache, *meta in batches]
        caches["ours (fp8 KV per token-head)"] = (inline_batches, (), kv_bytes // 2)
    rows = []
    for kernel, (cached, scales, read) in caches.items():  # each against the reference over the same cache
        cache_ref = attention_ops.paged_attention_reference(*cached[0], scale, *(scales[0] if scales else ()))
        for config in configs:
            calls = [
                partial(attention.run_paged_attention, *b, scale, config, *(scales[i] if scales else ()))
                for i, b in enumerate(cached)
            ]
            err = rel_err(calls[0](), cache_ref)
            ms = graph_ms(calls)
            rows.append(dict(kernel=kernel, config=asdict(config), rel_err=err, ms=ms, tbps=read / ms / 1e9))
    if sdpa and len(set(seq_lens)) == 1:
        for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                inputs = [
                    sdpa_call(q.unsqueeze(2), *contiguous_kv(cache, tables, seq_lens[0]), False, backend)
                    for q, cache, tables, _, _ in batches
                ]
            except RuntimeError as exc:
                rows.append(dict(kernel=name, error=str(exc).splitlines()[0]))
                continue
            expanded = inputs[0][1]
            err = rel_err(inputs[0][0]().reshape(ref.shape), ref)
            ms = graph_ms([call for call, _ in inputs])
            read = kv_bytes * (Q_HEADS // KV_HEADS if expanded else 1)
            name += " (K/V expanded)" if expanded else ""
            rows.append(dict(kernel=name, rel_err=err, ms=ms, tbps=read / ms / 1e9))
            del inputs
    for row in rows:
        row.update(case=f"decode {label}")
    return rows


def bench_row_kernels(copy_tbps: float) -> list[dict]:
    """Row kernels at a prefill-sized step: achieved bandwidth, ours against the torch reference."""
    tokens, hidden, inter = 8192, 4096, 14336
    x, res = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(2))
    w = torch.randn(hidden, device="cuda", dtype=DTYPE)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
    qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
    q, k, v = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in (q, k, v))
    table = rope_cos_sin_cache(rope_inv_freq(HEAD_DIM, 500000.0, None), 8192).cuda()
    positions = torch.arange(tokens, device="cuda")
    cache = torch.randn(2, tokens // BLOCK_SIZE, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(tokens, device="cuda")
    act = 2  # bytes per bf16 element
    cases = [
        ("rms_norm", 2 * tokens * hidden * act, lambda: norm.rms_norm(x, w, 1e-6),
         lambda: norm_ops.rms_norm_reference(x, w, 1e-6)),
        ("fused_add_rms_norm_quant_fp8", tokens * hidden * (3 * act + 1),
         lambda: norm.fused_add_rms_norm_quant_fp8(x, res, w, 1e-6),
         lambda: quant_ops.fused_add_rms_norm_quant_fp8_reference(x, res, w, 1e-6)),
        ("silu_and_mul", 3 * tokens * inter * act, lambda: activation.silu_and_mul(gate_up),
         lambda: silu_and_mul_reference(gate_up)),
        ("silu_and_mul_quant_fp8", tokens * inter * (2 * act + 1), lambda: activation.silu_and_mul_quant_fp8(gate_up),
         lambda: quant_ops.silu_and_mul_quant_fp8_reference(gate_up)),
        # block-128 FP8 models: a scale per token and 128 columns
        ("fused_add_rms_norm_quant_fp8/128", tokens * hidden * (3 * act + 1),
         lambda: norm.fused_add_rms_norm_quant_fp8(x, res, w, 1e-6, 128),
         lambda: quant_ops.fused_add_rms_norm_quant_fp8_reference(x, res, w, 1e-6, 128)),
        ("silu_and_mul_quant_fp8/128", tokens * inter * (2 * act + 1),
         lambda: activation.silu_and_mul_quant_fp8(gate_up, 128),
         lambda: quant_ops.silu_and_mul_quant_fp8_reference(gate_up, 128)),
        ("rope_and_cache", 2 * qkv.numel() * act,
         lambda: rotary_cache.rope_and_cache(positions, q, k, v, table, cache, slots),
         lambda: attention_ops.rope_and_cache_reference(positions, q, k, v, table, cache, slots)),
    ]  # fmt: skip
    rows = []
    for name, nbytes, ours, reference in cases:
        ms, ref_ms = median_ms(ours), median_ms(reference)
        tbps = nbytes / ms / 1e9
        rows.append(
            dict(case=name, kernel="ours", ms=ms, tbps=tbps, of_copy=tbps / copy_tbps, torch_reference_ms=ref_ms)
        )
    return rows


def torch_draw(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The draw as torch ops (the sampler's before `sample_rows`): softmax, exponential noise, argmax of the ratio."""
    probs = (logits / temperature.unsqueeze(1)).softmax(dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def bench_sample(copy_tbps: float, vocab: int = 151_936) -> list[dict]:
    """`sample_rows` per batch: greedy (torch's argmax beside it) and drawn at T = 0.8 (torch's draw beside it)."""
    rows = []
    for batch in (1, 8, 64, 256):
        logits = torch.randn(batch, vocab, device="cuda") * 4
        seeds = torch.arange(batch, device="cuda") + 12345
        positions = torch.full((batch,), 400, dtype=torch.int32, device="cuda")
        for temperature in (0.0, 0.8):
            t = torch.full((batch,), temperature, device="cuda")
            reference = partial(logits.argmax, dim=-1) if temperature == 0 else partial(torch_draw, logits, t)
            ms = graph_ms([partial(sampling.sample_rows, logits, t, seeds, positions)])
            tbps = logits.numel() * 4 / ms / 1e9
            rows.append(
                dict(
                    case=f"sample b{batch} T{temperature}",
                    kernel="ours",
                    ms=ms,
                    tbps=tbps,
                    of_copy=tbps / copy_tbps,
                    torch_reference_ms=graph_ms([reference]),
                )
            )
    return rows


def prefill_sweep(base: attention.AttentionConfig) -> list[attention.AttentionConfig]:
    """The default first, then other prefill tiles (the fields decode-only launches ignore)."""
    tiles = [(128, 32, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (256, 32, 8, 3), (256, 128, 8, 3), (256, 64, 8, 4)]
    return [base] + [replace(base, block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def decode_sweep(base: attention.AttentionConfig) -> list[attention.AttentionConfig]:
    """The default first, then other decode tiles, programs a multiprocessor (splits; for any batch) and warps, a
    lone sequence's pipeline stages, and merges of half and twice the partials a load."""
    variants = [(128, 4, 4), (128, 2, 4), (128, 1, 4), (64, 2, 4), (64, 1, 4), (32, 1, 4), (64, 1, 2)]
    variants.append((base.decode_block_n, base.decode_waves, 8))
    return (
        [base]
        + [
            replace(
                base,
                decode_block_n=n,
                unsplit_block_n=n,
                decode_waves=waves,
                lone_decode_waves=waves,
                decode_warps=warps,
            )
            for n, waves, warps in variants
        ]
        + [replace(base, lone_decode_stages=stages) for stages in (1, 2, 3) if stages != base.lone_decode_stages]
        + [replace(base, merge_elements=elements) for elements in (base.merge_elements // 2, base.merge_elements * 2)]
    )


HEADER = f"{'case':<30}{'kernel':<28}{'ms':>9}{'TFLOP/s':>9}{'TB/s':>7}{'rel_err':>9}  config"


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<30}{r['kernel']:<28}  error: {r['error'][:80]}")
            continue
        tflops = f"{r['tflops']:.0f}" if "tflops" in r else ""
        tbps = f"{r['tbps']:.2f}" if "tbps" in r else ""
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        config = ",".join(str(v) for v in r["config"].values()) if "config" in r else ""
        if "torch_reference_ms" in r:
            config = f"torch reference {r['torch_reference_ms']:.4f} ms"
        print(f"{r['case']:<30}{r['kernel']:<28}{r['ms']:>9.4f}{tflops:>9}{tbps:>7}{err:>9}  {config}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_kernels.json"))
    parser.add_argument("--sweep", action="store_true", help="also time other attention tile configs")
    parser.add_argument("--only", choices=["prefill", "decode", "rows", "sample"], help="one group of cases")
    parser.add_argument("--fp8-kv", action="store_true", help="decode also from an FP8 cache")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    torch.manual_seed(0)
    base = attention.default_config(HEAD_DIM)
    prefill_configs, decode_configs = (prefill_sweep(base), decode_sweep(base)) if args.sweep else ([base], [base])

    print(HEADER, flush=True)
    copy_tbps = copy_bandwidth() / 1e12
    rows = [dict(case="copy 2 GiB", kernel="torch copy_", ms=0.0, tbps=copy_tbps)]
    print_rows(rows)
    steps = {
        "prefill": [
            partial(bench_prefill, 8, 1024, prefill_configs, check=True),
            partial(bench_prefill, 1, 8192, prefill_configs, check=False),
        ],
        "decode": [],
        "rows": [partial(bench_row_kernels, copy_tbps)],
        "sample": [partial(bench_sample, copy_tbps)],
    }
    bench_decode_kv = partial(bench_decode, fp8_kv=args.fp8_kv)
    gen = torch.Generator().manual_seed(1)
    for batch, ctx in ((64, 2048), (128, 1536), (256, 1024)):
        mixed = torch.randint(1024, 2049, (batch,), generator=gen).tolist()
        steps["decode"].append(partial(bench_decode_kv, [ctx] * batch, f"b{batch} ctx{ctx}", decode_configs, sdpa=True))
        steps["decode"].append(partial(bench_decode_kv, mixed, f"b{batch} ctx1024-2048", [base], sdpa=False))
    for batch, ctx in ((8, 4096), (32, 2048)):  # between batch 1 and the batch >= 64 target
        steps["decode"].append(partial(bench_decode_kv, [ctx] * batch, f"b{batch} ctx{ctx}", decode_configs, sdpa=True))
    for ctx in (4096, 2048, 1024):  # a lone sequence: its splits are its only parallelism
        steps["decode"].append(partial(bench_decode_kv, [ctx], f"b1 ctx{ctx}", decode_configs, sdpa=True))
    # bench_decode.py's batch 1
    steps["decode"].append(partial(bench_decode_kv, [432], "b1 ctx432", decode_configs, sdpa=True))
    # Mixed steps: one of the offline run at a 512-token budget (RESULTS, twenty-fifth session; 167 decodes beside a
    # 345-token chunk at 1,024 keys cached, against the same decodes alone) and others around it. Each with the
    # default launch, its tiles after the decode programs on one stream, and that with the large tiles only.
    serial = replace(base, tiles_beside_decodes=False)
    mixed_configs = [base, serial, replace(serial, small_block_m=base.block_m, small_warps=base.num_warps)]
    decodes = torch.randint(1024, 1281, (167,), generator=gen).tolist()
    steps["decode"].append(partial(bench_decode_kv, decodes, "b167 ctx1024-1280", [base], sdpa=False))
    long_decodes = torch.randint(1024, 2049, (256,), generator=gen).tolist()
    for label, seq_lens, query_lens in (
        ("b167 ctx1024-1280 + a 345-token chunk", [*decodes, 1024 + 345], [1] * 167 + [345]),
        ("b256 ctx1024-2048 + a 1024 prompt", [*long_decodes, 1024], [1] * 256 + [1024]),
        ("b256 ctx1024-2048 + 2048 at 1024", [*long_decodes, 1024 + 2048], [1] * 256 + [2048]),
        ("b16 ctx1024-2048 + 512 at 512", [*long_decodes[:16], 1024], [1] * 16 + [512]),
        ("a 1024-token prompt alone", [1024], [1024]),
    ):
        step = partial(bench_decode_kv, seq_lens, label, mixed_configs, sdpa=False, query_lens=query_lens)
        steps["decode"].append(step)
    for step in steps[args.only] if args.only else [s for group in steps.values() for s in group]:
        new_rows = step()
        print_rows(new_rows)
        rows += new_rows

    write_json(
        args.out,
        dict(
            multiprocessors=torch.cuda.get_device_properties(0).multi_processor_count,
            torch=torch.__version__,
            triton=triton.__version__,
            python=platform.python_version(),
            copy_tbps=copy_tbps,
            results=rows,
        ),
    )


if __name__ == "__main__":
    main()
