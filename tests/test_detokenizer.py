"""Incremental detokenization: multi-byte UTF-8 across tokens, stop strings across tokens, held-back text."""

from __future__ import annotations

from atom_models.checkpoints import byte_level_tokenizer
from atom_runtime.detokenizer import IncrementalDetokenizer
from atom_runtime.sampling_params import SamplingParams

TOKENIZER = byte_level_tokenizer()


def feed(text: str, **params) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    detok = IncrementalDetokenizer(TOKENIZER.backend_tokenizer, TOKENIZER.encode("prompt"), SamplingParams(**params))
    shown, stop = [], None
    for token in TOKENIZER.encode(text):  # one byte per token: multi-byte characters span tokens
        stop = detok.add(token)
        shown.append(detok.releasable(finished=stop is not None))
        if stop:
            break
    return detok, shown, stop


def test_multibyte_characters_appear_whole():
    text = "héllo wörld 日本語 🎉!"
    detok, shown, _ = feed(text)
    assert detok.text == text
    assert all("\ufffd" not in s for s in shown)
    assert all(text.startswith(s) for s in shown)


def test_stop_string_across_tokens_is_cut_and_never_shown():
    detok, shown, stop = feed("one two STOP three", stop=["STOP"])
    assert stop == "STOP"
    assert detok.text == "one two "
    assert all("S" not in s for s in shown)  # the possible start of the stop string was held back


def test_stop_string_kept_when_asked():
    detok, _, stop = feed("one two STOP three", stop=["STOP"], include_stop_str_in_output=True)
    assert stop == "STOP" and detok.text == "one two STOP"


def test_earliest_of_several_stop_strings_wins():
    detok, _, stop = feed("abc xyz def", stop=["def", "xyz"])
    assert stop == "xyz" and detok.text == "abc "


def test_invalid_bytes_flush_at_the_end():
    detok = IncrementalDetokenizer(TOKENIZER.backend_tokenizer, [], SamplingParams())
    tokens = TOKENIZER.encode("ok") + [0xC3]  # a lone lead byte: never becomes a character
    for token in tokens:
        detok.add(token)
    detok.flush()
    assert detok.text == TOKENIZER.decode(tokens)


def test_stop_strings_count_only_past_min_tokens():
    """As vLLM: a stop string that ends within the first min_tokens tokens does not stop the output; one that ends
    after them does, even where it began before (the short stop "ab" is not found again later)."""
    detok, _, stop = feed("STOPxySTOPz", stop=["STOP"], min_tokens=5)
    assert stop == "STOP" and detok.text == "STOPxy"
    detok, _, stop = feed("xSTOPy", stop=["STOP"], min_tokens=3)
    assert stop == "STOP" and detok.text == "x"
    detok, _, stop = feed("xabcd", stop=["ab", "longstop"], min_tokens=3)
    assert stop is None and detok.text == "xabcd"


def test_a_prompt_ending_inside_a_character_stays_out_of_the_text():
    """Prompt token ids that end with part of a character: the output's first tokens complete it (as vLLM's
    stream, primed with the prompt), and none of the prompt's text comes out with them."""
    head = TOKENIZER.encode("日")
    detok = IncrementalDetokenizer(TOKENIZER.backend_tokenizer, TOKENIZER.encode("ab") + head[:2], SamplingParams())
    for token in head[2:] + TOKENIZER.encode("c"):
        detok.add(token)
    detok.flush()
    assert detok.text == "日c"
