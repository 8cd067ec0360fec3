"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
_FLOAT32_MAX = 3.4028234663852886e38


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI error shape)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (EBNF, xgrammar's dialect of GBNF)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            found = ", ".join(given) or "none"
            raise InvalidRequestError(f"structured outputs take one constraint, got {found}", "structured_outputs")
        types = {"json": (dict, str), "regex": str, "grammar": str, "choice": list}
        for name, kinds in types.items():
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kinds):
                raise InvalidRequestError(f"structured outputs: {name} has the wrong type", "structured_outputs")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("structured outputs: json_object must be true or false", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a list of non-empty strings", "structured_outputs")

    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on: its kind and text."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)  # (properties in order)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:  # an EBNF alternation of the strings (JSON's escapes are EBNF's)
            return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        return "grammar", self.grammar


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the end of the context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top logprobs per generated token, besides the sampled one
    prompt_logprobs: int | None = None  # the same per prompt token after the first (computed, never cached)
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits before sampling
    allowed_token_ids: list[int] | None = None  # sample only among these
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as the context holds)
    bad_words: list[str] | None = None  # words never completed (their last token is banned where it would)
    # bad_words as token sequences (`tokenize_bad_words`), filled in by the engine from its tokenizer
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: outputs carry token ids only (no text), sparing per-token decoding

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Normalise and validate the fields; call again after changing them."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()
        # Read once per token by the engine: plain attributes, not properties.
        self.greedy = self.temperature < _GREEDY_EPS
        self.sample_temperature = 0.0 if self.greedy else self.temperature  # what `sample_rows` takes
        self.filters = self.top_k > 0 or self.top_p < 1 or self.min_p > 0
        self.needs_penalties = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        self.shapes_logits = (
            bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)
        )
        # The next step waits for this one's tokens on the host: penalties count them, a grammar's mask and bad words
        # follow them.
        self.needs_host_tokens = (
            self.needs_penalties or self.structured_outputs is not None or bool(self.bad_words_token_ids)
        )

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param)

        check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        check(
            0 <= self.temperature < _FLOAT32_MAX,  # the sampler divides float32 logits by it
            "temperature",
            f"temperature must be >= 0 and finite, got {self.temperature}",
        )
        check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed", f"seed must fit in 64 bits, got {self.seed}")
        check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= -1, "top_k", f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
        )
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        check(
            0 < self.repetition_penalty < _FLOAT32_MAX,  # the sampler's float32: 1e39 would be inf, 0 * inf NaN
            "repetition_penalty",
            f"repetition_penalty must be positive and finite, got {self.repetition_penalty}",
        )
        check(self.logprobs is None or self.logprobs >= 0, "logprobs", f"logprobs must be >= 0, got {self.logprobs}")
        check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs",
            f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
        )
        check(
            all(isinstance(t, int) and abs(b) < _FLOAT32_MAX for t, b in (self.logit_bias or {}).items()),
            "logit_bias",
            "logit_bias maps token ids (ints) to finite biases",
        )
        check(
            self.allowed_token_ids is None
            or (self.allowed_token_ids and all(isinstance(t, int) for t in self.allowed_token_ids)),
            "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of token ids",
        )
        check(all(w.strip() for w in self.bad_words or ()), "bad_words", "bad_words cannot contain an empty word")
        check(
            self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}",
        )
        check(all(self.stop), "stop", "stop cannot contain an empty string")
        check(self.detokenize or not self.stop, "stop", "stop strings need detokenize=True")


def with_defaults(defaults: dict, **fields) -> SamplingParams:
    """SamplingParams of `fields`, where one left None takes `defaults` (a model's generation config:
    `loading.sampling_defaults`), else SamplingParams' own. A default max_tokens caps max_tokens, whose None means up
    to the end of the context; a max_tokens not passed at all is SamplingParams' default."""
    if (cap := defaults.get("max_tokens")) is not None:
        fields["max_tokens"] = cap if fields.get("max_tokens") is None else min(fields["max_tokens"], cap)
    merged = {name: value for name, value in defaults.items() if fields.get(name) is None}
    merged |= {name: value for name, value in fields.items() if value is not None or name == "max_tokens"}
    return SamplingParams(**merged)


def tokenize_bad_words(words: list[str], encode) -> list[list[int]]:
    """Each bad word as the token sequences that write it (vLLM's rule): on its own, and after a space where that is
    another sequence of the same length (a word-initial token), so that it is banned at the start and in the middle
    of text. `encode`: text -> token ids, without special tokens."""
    sequences = []
    for word in words:
        alone = encode(word.lstrip())
        sequences.append(alone)
        spaced = encode(" " + word.lstrip())
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return sequences
