"""FP8 against the unquantized model: top-1 agreement and KL divergence of next-token distributions.

    python benchmarks/bench_fp8_accuracy.py --preset qwen3-0.6b --num-hidden-layers 4   # a random model made here
    python benchmarks/bench_fp8_accuracy.py MODEL_DIR --text heldout.txt --device cuda

Any unquantized HF model directory works (the trained demo model included). Its weights are
quantized online, one variant at a time, and every variant is compared with the same model in
`--dtype` (bf16 by default) at every position of the same token windows:

- fp8 kv only: the unquantized model with an FP8 KV cache (per-tensor scale 1.0), and `per token-head only` with a
  scale per token and head;
- weights: per-channel FP8 weights, activations in the model dtype (weight-only);
- weights+acts: per-channel weights and dynamic per-token FP8 activations (`--quantization fp8`);
- +fp8 kv: the same with an FP8 KV cache (per-tensor scale 1.0, as without calibration);
- +fp8 kv per token-head: the same with a scale per token and head, kept inline in the cache;
- block weights+acts: 128x128 weight blocks (DeepSeek-V3 / Qwen3-FP8 style), where the model's
  packed shards are whole blocks.

Top-1 agreement: how often both pick the same next token, with its 95% (Wilson) interval over the
positions; KL(unquantized || FP8) of the next-token
distributions, mean and 99th percentile. Tokens come from `--text` (a file, or a directory of .txt
files: held-out text, for which perplexity is reported too) or are random (random models have no
text they predict). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
from pathlib import Path

import torch
from bench_common import print_table, write_json
from transformers import AutoTokenizer

from atom_models import load_config, resolve_dtype
from atom_models.checkpoints import PRESETS, make_random_checkpoint
from atom_models.layers import AttentionMetadata
from atom_models.llama import head_dim_of
from atom_models.loader import build_model, load_weights
from atom_models.ops import default_backend, set_backend
from atom_models.ops.attention import INLINE_SCALE_DTYPE, kv_cache_shape
from atom_models.ops.quant import FP8_DTYPE
from atom_models.quantization import QuantizationConfig

BLOCK_SIZE = 16
# name -> (quantization config, KV-cache dtype: None for the model dtype)
VARIANTS = {
    "fp8 kv only": (None, FP8_DTYPE),  # unquantized weights and activations, FP8 cache
    "fp8 kv per token-head only": (None, INLINE_SCALE_DTYPE),
    "weights": (QuantizationConfig.online_fp8(activations="none"), None),
    "weights+acts": (QuantizationConfig.online_fp8(), None),
    "+fp8 kv": (QuantizationConfig.online_fp8(), FP8_DTYPE),
    "+fp8 kv per token-head": (QuantizationConfig.online_fp8(), INLINE_SCALE_DTYPE),
    "block weights+acts": (QuantizationConfig.online_fp8("block", block_size=(128, 128)), None),
}


def token_windows(model_dir: Path, text: Path | None, vocab: int, positions: int, seq_len: int) -> torch.Tensor:
    """[windows, seq_len + 1] token ids covering at least `positions` predictions."""
    windows = math.ceil(positions / seq_len)
    if text is None:
        return torch.randint(0, vocab, (windows, seq_len + 1), generator=torch.Generator().manual_seed(0))
    files = sorted(text.glob("*.txt")) if text.is_dir() else [text]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stream = torch.tensor(tokenizer("\n\n".join(f.read_text() for f in files))["input_ids"])
    available = (stream.numel() - 1) // seq_len
    if available < windows:
        raise SystemExit(f"{text} has {stream.numel()} tokens: too few for {positions} positions of {seq_len}")
    return stream[: windows * seq_len + 1].unfold(0, seq_len + 1, seq_len)


@torch.inference_mode()
def window_logits(model, ids: torch.Tensor, kv_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """fp32 logits at every position of one window (one prefill through a fresh paged cache)."""
    config = model.config
    n = ids.numel()
    blocks = -(-n // BLOCK_SIZE)
    shape = kv_cache_shape(kv_dtype, blocks, BLOCK_SIZE, config.num_key_value_heads, head_dim_of(config))
    caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(config.num_hidden_layers)]
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata.one_prompt(n, torch.arange(blocks, device=device), BLOCK_SIZE)
    return model(ids.to(device), positions, caches, meta, positions).float()


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a proportion (Wilson score), e.g. top-1 agreement over n positions."""
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return center - half, center + half


def compare(reference: list[torch.Tensor], logits: list[torch.Tensor], targets: list[torch.Tensor]) -> dict:
    ref, got = torch.cat(reference), torch.cat(logits)
    ref_logp, got_logp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)
    target = torch.cat(targets).to(ref.device)
    nll = -got_logp.gather(-1, target[:, None]).mean().item()
    agree = int((ref.argmax(-1) == got.argmax(-1)).sum())
    low, high = wilson_interval(agree, ref.shape[0])
    return {
        "positions": ref.shape[0],
        "top1_agreement": agree / ref.shape[0],
        "top1_interval": f"{low:.4f}-{high:.4f}",
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
        "perplexity": math.exp(nll),
    }


def evaluate(model_dir: Path, args: argparse.Namespace) -> list[dict]:
    config = load_config(model_dir)
    if getattr(config, "quantization_config", None):
        raise SystemExit(f"{model_dir} is already quantized: give the unquantized checkpoint")
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype, config)
    set_backend(default_backend(device))
    windows = token_windows(model_dir, args.text, config.vocab_size, args.positions, args.seq_len)
    inputs, targets = windows[:, :-1], windows[:, 1:].reshape(-1)

    def run(quant, kv_dtype):
        model = build_model(config, dtype, device, quant)
        load_weights(model, model_dir, progress=False)
        return [window_logits(model, ids, kv_dtype or dtype, device) for ids in inputs]

    reference = run(None, None)
    rows = [{"variant": f"unquantized ({args.dtype})", **compare(reference, reference, [targets])}]
    for name, (quant, kv_dtype) in VARIANTS.items():
        if quant is not None:
            quant = dataclasses.replace(quant, exclude=[*quant.exclude, *args.keep])
        try:
            logits = run(quant, kv_dtype)
        except ValueError as error:  # block weights on a model whose packed shards are not whole blocks
            print(f"skipping {name}: {error}")
            continue
        rows.append({"variant": name, **compare(reference, logits, [targets])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, nargs="?", help="an unquantized HF model directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="instead of a model: a random one of this shape")
    parser.add_argument("--init", type=float, default=0.02, help="the random model's initializer range")
    parser.add_argument("--num-hidden-layers", type=int, default=None, help="the random model's depth")
    parser.add_argument("--text", type=Path, default=None, help="held-out text (file or directory of .txt)")
    parser.add_argument("--positions", type=int, default=1024, help="next-token predictions compared (>= 1000)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--keep",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="layers every variant leaves unquantized, as checkpoint-name patterns (e.g. 'model.layers.0.*')",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_fp8_accuracy.json"))
    args = parser.parse_args()
    if (args.model is None) == (args.preset is None):
        parser.error("give a model directory or --preset")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            depth = {} if args.num_hidden_layers is None else {"num_hidden_layers": args.num_hidden_layers}
            model_dir = make_random_checkpoint(
                Path(tmp) / args.preset, args.preset, initializer_range=args.init, **depth
            )
        rows = evaluate(model_dir, args)
    source = args.model or f"random {args.preset} (init {args.init})"
    if args.keep:
        source = f"{source}, unquantized: {' '.join(args.keep)}"
    tokens = args.text or "random tokens"
    print_table(
        f"FP8 vs {args.dtype}: {source}, {rows[0]['positions']} positions of {tokens}",
        rows,
        [
            ("variant", "variant".rjust(20), ">20"),
            ("top1_agreement", "top-1 agree", ".4f"),
            ("top1_interval", "95% interval", ">13"),
            ("kl_mean", "KL mean", ".5f"),
            ("kl_p99", "KL p99", ".5f"),
            ("perplexity", "perplexity", ".3f"),
        ],
    )
    write_json(args.out, {"model": str(source), "tokens": str(tokens), "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
