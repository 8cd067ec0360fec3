"""Structured outputs (vLLM's): a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar
constrains what a request may generate. xgrammar compiles the constraint against the tokenizer's vocabulary once
(cached); a matcher a sequence then gives each step the tokens allowed next (a bitmask the sampler applies to the
logits) and takes the token drawn. The matcher needs every token before the next step's mask, so such a request's
steps wait for their tokens on the host, as penalties do.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from atom_runtime.sampling_params import InvalidRequestError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


class Grammars:
    """xgrammar's compiler over one tokenizer, with its cache of compiled constraints."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: set[int]):
        import xgrammar  # imported by the first request that needs it, not by every engine

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.compiler = xgrammar.GrammarCompiler(info)
        self.new_matcher = xgrammar.GrammarMatcher

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        kind, text = params.key()
        compile_kind = {
            "json": self.compiler.compile_json_schema,
            "json_object": lambda _: self.compiler.compile_json_schema('{"type": "object"}'),  # an object, as OpenAI
            "regex": self.compiler.compile_regex,
            "grammar": self.compiler.compile_grammar,
        }[kind]
        try:
            return compile_kind(text)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's, for a schema, regex or grammar it refuses
            # "[12:00:00] /project/cpp/regex_converter.cc:83: Regex parsing error ...": the message after the place
            reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(error).strip()).splitlines()
            message = reason[0] if reason else type(error).__name__
            raise InvalidRequestError(f"structured outputs: invalid {kind}: {message}", "structured_outputs") from None


def apply_masks(logits: Tensor, matchers: list[Any]) -> None:
    """Each row's matcher's allowed next tokens, in place: the others' logits to -inf (rows without one untouched)."""
    import xgrammar

    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def accept(matcher: Any, token: int) -> bool | None:
    """Take the token drawn: True when the constraint is complete (nothing more may follow), False while it goes on,
    None if it refuses the token, which the sampler draws only when the request's other settings (allowed_token_ids,
    bad_words, a -100 logit_bias) left none of the tokens the grammar allows."""
    if not matcher.accept_token(token):
        logger.warning("structured outputs: nothing the grammar allows was left to draw; the sequence ends (abort)")
        return None
    return matcher.is_terminated()
