"""Evaluate the demo model on its held-out pages and write the evaluation into its README.

    python benchmarks/eval_demo_model.py --model atom_models/demo --corpus demo_corpus --write-readme

Perplexity is HF `transformers` (fp32, CPU) over the held-out pages' token stream (each page followed
by <|endoftext|>, as in training), in non-overlapping windows of the model's context; bits per byte
divide the same total loss by the pages' UTF-8 size, so they compare across tokenizers. The samples are
atom's greedy continuations (CPU, eager) of the first words of held-out sentences, and chat replies
through the chat template. Prints markdown; `--out` also writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from train_demo_model import read_documents, token_stream, write_readme
from transformers import AutoModelForCausalLM, AutoTokenizer

from atom_runtime import LLM, SamplingParams

PROMPT_WORDS = 10
SAMPLES = 3
SAMPLE_TOKENS = 48
CHAT_QUESTIONS = ["What does json.dumps() do?", "What does “decorator” mean in Python?"]


def heldout_perplexity(model_dir: Path, documents: list[str]) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stream = token_stream(tokenizer, documents)
    window = model.config.max_position_embeddings
    total = 0.0
    with torch.inference_mode():
        for start in range(0, stream.numel() - 1, window):
            chunk = stream[start : start + window + 1]
            logits = model(input_ids=chunk[None, :-1]).logits[0]
            total += F.cross_entropy(logits.float(), chunk[1:], reduction="sum").item()
    tokens = stream.numel() - 1
    text_bytes = sum(len(doc.encode()) for doc in documents)
    return {
        "documents": len(documents),
        "tokens": tokens,
        "loss": round(total / tokens, 4),
        "perplexity": round(math.exp(total / tokens), 2),
        "bits_per_byte": round(total / math.log(2) / text_bytes, 4),
    }


def sample_prompts(documents: list[str]) -> list[tuple[str, str]]:
    """(prompt, original text) from the first prose paragraph of the first held-out pages that have one."""
    prompts = []
    for doc in documents:
        for paragraph in doc.split("\n\n"):
            words = paragraph.split()
            if len(words) >= 2 * PROMPT_WORDS and paragraph[0].isupper() and paragraph.endswith("."):
                prompts.append((" ".join(words[:PROMPT_WORDS]), " ".join(words[PROMPT_WORDS : 3 * PROMPT_WORDS])))
                break
        if len(prompts) == SAMPLES:
            break
    return prompts


def generate_samples(model_dir: Path, prompts: list[tuple[str, str]]) -> dict:
    llm = LLM(model_dir, device="cpu")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=SAMPLE_TOKENS)
        outputs = llm.generate([prompt for prompt, _ in prompts], greedy)
        chats = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in CHAT_QUESTIONS
        ]
        replies = llm.generate(chats, SamplingParams(temperature=0, max_tokens=64))
    finally:
        llm.shutdown()
    return {
        "continuations": [
            {"prompt": prompt, "original": original, "model": out.outputs[0].text}
            for (prompt, original), out in zip(prompts, outputs, strict=True)
        ],
        "chat": [{"user": q, "assistant": out.outputs[0].text} for q, out in zip(CHAT_QUESTIONS, replies, strict=True)],
    }


def evaluation_markdown(perplexity: dict, samples: dict) -> str:
    lines = [
        "",
        "## Evaluation",
        "",
        f"Held-out perplexity: **{perplexity['perplexity']}** per token ({perplexity['bits_per_byte']} bits per byte) "
        f"over {perplexity['tokens']:,} tokens of the {perplexity['documents']} held-out pages "
        "(`benchmarks/eval_demo_model.py`: HF transformers, fp32, windows of the full context).",
        "",
        f"Greedy continuations by atom ({SAMPLE_TOKENS} tokens) of the first words of held-out sentences:",
    ]
    for sample in samples["continuations"]:
        lines += [
            "",
            f"- prompt: `{sample['prompt']}`",
            f"  - atom: {json.dumps(sample['prompt'] + sample['model'], ensure_ascii=False)}",
            f"  - original: {json.dumps(sample['prompt'] + ' ' + sample['original'] + ' …', ensure_ascii=False)}",
        ]
    lines += ["", "Chat through the ChatML template (greedy), as `/v1/chat/completions` serves it:"]
    for exchange in samples["chat"]:
        lines += [
            "",
            f"- user: {exchange['user']}",
            f"  - assistant: {json.dumps(exchange['assistant'], ensure_ascii=False)}",
        ]
    lines += [
        "",
        "```bash",
        'atom-run generate --prompt "The json module" --max-tokens 48 --temperature 0.7 --seed 0  # runs this model',
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Held-out perplexity and samples of the demo model.")
    parser.add_argument("--model", type=Path, default=Path("atom_models/demo"))
    parser.add_argument("--corpus", type=Path, default=Path("demo_corpus"))
    parser.add_argument("--write-readme", action="store_true", help="rewrite MODEL/README.md with the results")
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    args = parser.parse_args()
    documents = read_documents(args.corpus / "heldout.txt")
    perplexity = heldout_perplexity(args.model, documents)
    samples = generate_samples(args.model, sample_prompts(documents))
    markdown = evaluation_markdown(perplexity, samples)
    print(markdown)
    if args.out:
        args.out.write_text(json.dumps({"heldout": perplexity, **samples}, indent=2, ensure_ascii=False) + "\n")
    if args.write_readme:
        write_readme(args.model, json.loads((args.model / "training.json").read_text()), markdown)


if __name__ == "__main__":
    main()
