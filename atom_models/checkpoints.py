"""Random-weight HF checkpoints of real model shapes, for tests and benchmarks (there is no model hub).

    python -m atom_models.checkpoints tiny-llama /tmp/tiny-llama
    python -m atom_models.checkpoints llama-3-8b /tmp/llama-3-8b --dtype bfloat16
    python -m atom_models.checkpoints llama-3-8b /tmp/llama-3-8b-config --config-only   # for --load-dummy

Each directory gets config.json, safetensors weights and a byte-level BPE tokenizer with
a ChatML chat template, so every part of atom (tokenizer, chat, detokenizer) runs on it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PRESETS: dict[str, dict] = {
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=1024,
    ),
    "tiny-qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1e6,
    ),
}


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer over the 256 bytes plus ChatML specials: every string encodes, nothing to train."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def make_config(preset: str | dict, **overrides) -> PretrainedConfig:
    values = dict(PRESETS[preset]) if isinstance(preset, str) else dict(preset)
    values.update(overrides)
    model_type = values.pop("model_type")
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_type]
    tokenizer_size = len(byte_level_tokenizer())
    values.setdefault("eos_token_id", tokenizer_size - 1)  # <|im_end|>
    values.setdefault("bos_token_id", None)
    config = config_class(**values)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]]
    return config


def make_config_only(path: str | Path, preset: str | dict, **overrides) -> Path:
    """config.json and the tokenizer, no weights: enough for `--load-dummy` exports and benchmarks."""
    path = Path(path)
    make_config(preset, **overrides).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


def make_random_checkpoint(
    path: str | Path,
    preset: str | dict = "tiny-llama",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | int = "5GB",
    **overrides,
) -> Path:
    """Write an HF checkpoint with random weights (HF's own initialisation) and the byte tokenizer."""
    path = Path(path)
    config = make_config(preset, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    byte_level_tokenizer().save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight HF checkpoint of a known model shape.")
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("output", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-only", action="store_true", help="no weights: for --load-dummy runs")
    parser.add_argument("--num-hidden-layers", type=int, default=None, help="override the preset's depth")
    args = parser.parse_args()
    overrides = {} if args.num_hidden_layers is None else {"num_hidden_layers": args.num_hidden_layers}
    if args.config_only:
        make_config_only(args.output, args.preset, **overrides)
    else:
        make_random_checkpoint(args.output, args.preset, dtype=getattr(torch, args.dtype), seed=args.seed, **overrides)
    print(f"wrote {args.preset} to {args.output}")


if __name__ == "__main__":
    main()
