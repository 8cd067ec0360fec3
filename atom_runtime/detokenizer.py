"""Incremental detokenization with stop strings.

Text is decoded token by token with `tokenizers`' DecodeStream, which holds back bytes
until they form whole UTF-8 characters. Stop strings are matched on the text, across
token boundaries; the last `len(longest stop) - 1` characters are held back from the
stream until it is clear they do not start a stop string.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from atom_runtime.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context
# (leading spaces of SentencePiece-style vocabularies).
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        # Stepped through, not given as the stream's `ids`: a prompt that ends inside a character (token ids) would
        # then have no prefix the stream knows, and its whole text would come out with the first output token.
        for token_id in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]:
            self.stream.step(tokenizer, token_id)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens  # as vLLM: stop strings count once the output is past it
        self.num_tokens = 0
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special_tokens = params.skip_special_tokens
        self.pending: list[int] = []  # tokens the stream holds back, not yet valid UTF-8
        # The text so far, in pieces joined when read: without stop strings, nothing reads it per token.
        self.pieces: list[str] = []
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        if len(self.pieces) != 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0]

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if the text now contains one."""
        if self.stopped_by is not None:
            return None
        self.num_tokens += 1
        piece = self.stream.step(self.tokenizer, token_id)
        if piece is None:
            self.pending.append(token_id)
            return None
        if self.pending:
            self.pending.clear()
        if not self.stop:
            self.pieces.append(piece)
            return None
        return self._extend(piece)

    def flush(self) -> None:
        """At the end, decode what the stream still holds back (bytes that never became valid UTF-8)."""
        if self.pending and self.stopped_by is None:
            self._extend(self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special_tokens))
            self.pending.clear()

    def _extend(self, piece: str) -> str | None:
        text = self.text
        end = len(text)  # a stop string ends in the new piece: what came before had none, or was within min_tokens
        text += piece
        if self.num_tokens <= self.min_tokens:
            found = []
        else:
            found = [(at, stop) for stop in self.stop if (at := text.find(stop, max(0, end - len(stop) + 1))) >= 0]
        if not found:
            self.pieces[0] = text
            return None
        at, stop = min(found)
        self.pieces[0] = text[: at + len(stop) if self.include_stop else at]
        self.stopped_by = stop
        return stop

    def releasable(self, finished: bool) -> str:
        """Text safe to show: all of it once finished, else all but a possible stop-string start."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
