"""Train atom's embedded demo model: a small Llama on the Python documentation, with its own tokenizer.

    python benchmarks/prepare_demo_corpus.py --out demo_corpus
    python benchmarks/train_demo_model.py --corpus demo_corpus --out /tmp/demo --epochs 12        # GPU
    python benchmarks/train_demo_model.py --corpus demo_corpus --out /tmp/demo --steps 3 --smoke  # CPU check

A byte-level BPE tokenizer is trained on the training pages first (deterministic), then the model
with plain PyTorch: AdamW, linear warm-up then cosine decay, bf16 autocast on CUDA, random windows
of the token stream. The checkpoint with the lowest validation loss is saved (`save_pretrained`, fp32,
safetensors) with the tokenizer, `training.json` (seed, corpus, every hyper-parameter, losses) and
a README. `--time-budget` caps the step count: after a few timed steps the run fixes its step count
so it ends in time, and records it, so `--steps N` repeats the same schedule.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from atom_models.checkpoints import CHATML_TEMPLATE, SPECIAL_TOKENS

END_OF_TEXT, IM_END = SPECIAL_TOKENS[0], SPECIAL_TOKENS[2]
CALIBRATION = (5, 25)  # --time-budget times these steps (after the first, slow ones), then fixes the step count


@dataclass
class Hyper:
    """Everything that decides the trained weights, recorded in training.json."""

    seed: int = 0
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    epochs: float = 12.0
    steps: int | None = None  # fixed step count; default: from epochs (capped by the time budget)
    eval_every: int = 100


def read_documents(path: Path) -> list[str]:
    """The documents of one split file (written by prepare_demo_corpus.py)."""
    text = path.read_text(encoding="utf-8")
    return [doc.strip("\n") for doc in text.split(f"\n{END_OF_TEXT}\n") if doc.strip()]


def train_tokenizer(documents: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style: every string encodes) with the ChatML special tokens at ids 0-2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHATML_TEMPLATE,
        model_max_length=max_length,
    )


def token_stream(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> torch.Tensor:
    """All documents' tokens, each followed by <|endoftext|>, as one int64 tensor."""
    end = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(documents):
        ids.extend(encoding.ids)
        ids.append(end)
    return torch.tensor(ids, dtype=torch.int64)


def model_config(hyper: Hyper, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hyper.hidden_size,
        intermediate_size=hyper.intermediate_size,
        num_hidden_layers=hyper.num_hidden_layers,
        num_attention_heads=hyper.num_attention_heads,
        num_key_value_heads=hyper.num_key_value_heads,
        max_position_embeddings=hyper.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def learning_rate(hyper: Hyper, step: int, total: int) -> float:
    if step < hyper.warmup_steps:
        return hyper.lr * (step + 1) / hyper.warmup_steps
    progress = min(1.0, (step - hyper.warmup_steps) / max(1, total - hyper.warmup_steps))
    return hyper.lr * (hyper.min_lr_ratio + (1 - hyper.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_for(model: torch.nn.Module, hyper: Hyper, device: torch.device) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms (1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": hyper.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=hyper.lr, betas=(0.9, hyper.beta2), fused=device.type == "cuda")


def mean_loss(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, batch_size: int, device) -> float:
    """Mean next-token loss over non-overlapping windows of the whole stream."""
    windows = (stream.numel() - 1) // seq_len
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), autocast(device):
        for start in range(0, windows, batch_size):
            offsets = torch.arange(start, min(windows, start + batch_size)) * seq_len
            x, y = windows_at(stream, offsets, seq_len, device)
            logits = model(input_ids=x).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


def windows_at(stream: torch.Tensor, offsets: torch.Tensor, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    index = offsets[:, None] + torch.arange(seq_len + 1)
    batch = stream[index].to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def train(corpus: Path, out: Path, hyper: Hyper, device: torch.device, time_budget: float | None) -> dict:
    started = time.perf_counter()
    torch.manual_seed(hyper.seed)
    corpus_info = json.loads((corpus / "corpus.json").read_text())
    pages, chat = read_documents(corpus / "train.txt"), read_documents(corpus / "chat.txt")
    tokenizer = train_tokenizer(pages, hyper.vocab_size, hyper.max_position_embeddings)
    train_stream = token_stream(tokenizer, pages + chat)
    valid_stream = token_stream(tokenizer, read_documents(corpus / "valid.txt"))
    log(f"tokenizer: {len(tokenizer)} tokens; train stream {train_stream.numel():,}, valid {valid_stream.numel():,}")

    config = model_config(hyper, tokenizer)
    model = LlamaForCausalLM(config).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"model: {parameters:,} parameters on {device}")
    optimizer = optimizer_for(model, hyper, device)
    tokens_per_step = hyper.batch_size * hyper.seq_len
    steps = hyper.steps or math.ceil(hyper.epochs * train_stream.numel() / tokens_per_step)
    generator = torch.Generator().manual_seed(hyper.seed)
    best = {"valid_loss": float("inf"), "step": 0, "state": None}
    history = []
    train_started = time.perf_counter()
    step = 0
    while step < steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(hyper, step, steps)
        offsets = torch.randint(0, train_stream.numel() - hyper.seq_len - 1, (hyper.batch_size,), generator=generator)
        x, y = windows_at(train_stream, offsets, hyper.seq_len, device)
        with autocast(device):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hyper.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == CALIBRATION[0]:
            synchronize(device)
            calibration_started = time.perf_counter()
        elif step == CALIBRATION[1] and time_budget is not None and hyper.steps is None:
            synchronize(device)
            per_step = (time.perf_counter() - calibration_started) / (CALIBRATION[1] - CALIBRATION[0])
            fitting = int((time_budget - (time.perf_counter() - train_started)) / per_step) + step
            log(f"{per_step * 1e3:.1f} ms/step: {fitting} steps fit the time budget of {time_budget:.0f} s")
            steps = min(steps, fitting)
        if step % hyper.eval_every == 0 or step == steps:
            valid_loss = mean_loss(model, valid_stream, hyper.seq_len, hyper.batch_size, device)
            elapsed = time.perf_counter() - train_started
            record = {
                "step": step,
                "epoch": round(step * tokens_per_step / train_stream.numel(), 2),
                "train_loss": round(loss.item(), 4),
                "valid_loss": round(valid_loss, 4),
                "lr": optimizer.param_groups[0]["lr"],
                "tokens_per_s": round(step * tokens_per_step / elapsed),
            }
            history.append(record)
            log(json.dumps(record))
            if valid_loss < best["valid_loss"]:
                state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                best = {"valid_loss": valid_loss, "step": step, "state": state}
    train_seconds = time.perf_counter() - train_started

    model.load_state_dict(best["state"])
    training = {
        "hyper_parameters": asdict(hyper) | {"steps": steps},
        "corpus": {k: v for k, v in corpus_info.items() if not k.endswith("_pages")},
        "train_stream_tokens": train_stream.numel(),
        "valid_stream_tokens": valid_stream.numel(),
        "parameters": parameters,
        "best_step": best["step"],
        "best_valid_loss": round(best["valid_loss"], 4),
        "best_valid_perplexity": round(math.exp(best["valid_loss"]), 2),
        "tokens_seen": steps * tokens_per_step,
        "train_seconds": round(train_seconds, 1),
        "tokens_per_s": round(steps * tokens_per_step / train_seconds),
        "device": device_name(device),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "history": history,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    save(model.to(torch.float32), tokenizer, out, training)
    shutil.copy(corpus / "LICENSE-PSF.txt", out)  # the corpus's licence travels with the model
    log(f"saved step {best['step']} (valid loss {best['valid_loss']:.4f}) to {out}")
    return training


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, training: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the chat template inside tokenizer_config.json
    # Completions end at <|endoftext|> (the end of a page), chat replies at <|im_end|>.
    end_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(END_OF_TEXT)]
    GenerationConfig(eos_token_id=end_ids, pad_token_id=end_ids[1], do_sample=False).save_pretrained(out)
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    write_readme(out, training)


def write_readme(out: Path, training: dict, evaluation: str = "") -> None:
    """The model's README: what it is, its corpus and licence, how it was trained, and `evaluation` (markdown)."""
    hyper, corpus = training["hyper_parameters"], training["corpus"]
    shape = (
        f"{hyper['num_hidden_layers']} layers, hidden size {hyper['hidden_size']}, MLP {hyper['intermediate_size']}, "
        f"{hyper['num_attention_heads']} attention heads of {hyper['hidden_size'] // hyper['num_attention_heads']} "
        f"({hyper['num_key_value_heads']} KV heads), tied embeddings, vocabulary {hyper['vocab_size']}, "
        f"context {hyper['max_position_embeddings']}"
    )
    settings = ", ".join(f"{k}={v}" for k, v in hyper.items())
    defaults = asdict(Hyper())
    # The recorded step count replaces --epochs/--time-budget: the same schedule, step for step.
    flags = [
        f"--{k.replace('_', '-')} {v}" for k, v in hyper.items() if k == "steps" or (k != "epochs" and v != defaults[k])
    ]
    text = f"""# atom demo model

A small Llama-architecture language model trained from scratch on the Python 3.11 documentation, shipped
inside atom so that `atom-run generate --prompt "..."` works with no model download. It writes English
in the style of the Python docs and replies in the ChatML chat format; it knows little and is often
wrong. It exists to show atom running a real trained model, and as
the test bed for numerics (HF vs atom greedy tokens, quantization accuracy).

- Architecture: `LlamaForCausalLM`, {training["parameters"]:,} parameters ({shape}), fp32 safetensors.
- Tokenizer: byte-level BPE (`tokenizers`), {hyper["vocab_size"]} tokens including `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>`; ChatML chat template. Completions stop at `<|endoftext|>`, chat replies
  at `<|im_end|>`.

## Corpus and licence

- Debian package `{corpus["package"]}`, version `{corpus["version"]}` (sha256 of the .deb
  `{corpus["deb_sha256"]}`): the main text of each HTML page, extracted by
  `benchmarks/prepare_demo_corpus.py`. {corpus["train_documents"]} training pages
  ({corpus["train_characters"]:,} characters), {corpus["valid_documents"]} validation pages (choose the
  checkpoint), {corpus["heldout_documents"]} held-out pages ({corpus["heldout_characters"]:,} characters,
  never seen in training). A page's split is chosen by a hash of its path. Training also sees
  {corpus["chat_documents"]:,} ChatML exchanges drawn from the training pages: "What does X do?" answered
  by the first paragraph documenting X (glossary terms likewise).
- Licence: {corpus["license"]}. The PSF License Agreement grants a licence to "prepare derivative
  works, distribute, and otherwise use" Python and its documentation, provided the agreement and the
  PSF's copyright notice are retained: "Copyright © 2001-2023 Python Software Foundation; All Rights
  Reserved". Both licence texts are in `LICENSE-PSF.txt` beside this file. Summary of changes (the
  agreement's clause 3): the documentation's HTML pages were reduced to plain text and used only as
  training data for these weights, which can reproduce passages of it.

## Training

`benchmarks/train_demo_model.py` (plain PyTorch: AdamW, warm-up then cosine decay, bf16 autocast on CUDA),
{hyper["steps"]} steps of {hyper["batch_size"]} × {hyper["seq_len"]} tokens ({training["tokens_seen"]:,} tokens,
{training["tokens_seen"] / training["train_stream_tokens"]:.1f} passes over {training["train_stream_tokens"]:,} training
tokens) in {training["train_seconds"]} s on {training["device"]} ({training["tokens_per_s"]:,} tokens/s);
the step with the lowest validation loss ({training["best_step"]}, perplexity {training["best_valid_perplexity"]})
is the one shipped. Settings: {settings}. Versions: {", ".join(f"{k} {v}" for k, v in training["versions"].items())}.
`training.json` holds the loss curve. Reproduce: `python benchmarks/prepare_demo_corpus.py && python
benchmarks/train_demo_model.py --out DIR {" ".join(flags)}`.
{evaluation}"""
    (out / "README.md").write_text(text)


def log(message: str) -> None:
    print(f"[train] {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the embedded demo model.")
    parser.add_argument("--corpus", type=Path, default=Path("demo_corpus"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds of training; caps the step count")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes for a quick CPU check of the whole script")
    for field, default in asdict(Hyper()).items():
        kind = int if field == "steps" else type(default)
        parser.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default)
    args = parser.parse_args()
    hyper = Hyper(**{field: getattr(args, field) for field in asdict(Hyper())})
    if args.smoke:
        hyper = replace(hyper, vocab_size=512, batch_size=4, seq_len=64, warmup_steps=2)
    train(args.corpus, args.out, hyper, torch.device(args.device), args.time_budget)


if __name__ == "__main__":
    main()
