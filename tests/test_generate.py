"""The offline API: batching through the paged KV cache, stopping, sampling."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import shutil
import sys
import threading
import time

import pytest
import torch
import uvloop

from atom_runtime import LLM, SamplingParams, StructuredOutputsParams
from atom_runtime.async_engine import TOKENIZE_INLINE_MAX_CHARS
from atom_runtime.core_client import EngineProcessSettings
from atom_runtime.sampling_params import tokenize_bad_words

PROMPTS = ["Hello", "The quick brown fox jumps over", "a", "Once upon a time, in a land far away, there"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(tiny_llama, device="cpu", block_size=4)
    yield engine
    engine.shutdown()


def test_output_shape(llm):
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 24
        assert completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_batch_equals_each_prompt_alone(llm):
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_chunked_prefill_and_small_budget_give_same_tokens(tiny_llama, llm):
    small = LLM(tiny_llama, device="cpu", block_size=4, max_num_batched_tokens=5, max_num_seqs=2)
    try:
        got = [o.outputs[0].token_ids for o in small.generate(PROMPTS, GREEDY)]
    finally:
        small.shutdown()
    assert got == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_prompt_token_ids_input(llm):
    ids = llm.tokenizer.encode(PROMPTS[1])
    assert llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)[0].outputs[0].token_ids == (
        llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids
    )


def test_prompts_as_vllm_takes_them(llm):
    ids = llm.tokenizer.encode(PROMPTS[1])
    by_text = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids
    outputs = llm.generate([{"prompt": PROMPTS[1]}, {"prompt_token_ids": ids}], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [by_text, by_text] and outputs[0].prompt == PROMPTS[1]
    for bad in ([1, 2, 3], {"prompt": 5}, {"prompt": "x", "extra": 1}, [{"text": "x"}]):
        with pytest.raises(TypeError, match="a prompt is a string"):
            llm.generate(bad, GREEDY)


def test_vllm_arguments(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size 2: atom runs a model on one device"):
        LLM(tiny_llama, device="cpu", tensor_parallel_size=2)
    one = LLM(tiny_llama, device="cpu", tensor_parallel_size=1, trust_remote_code=True)
    assert one.get_tokenizer() is one.tokenizer
    one.shutdown()
    with pytest.raises(RuntimeError, match="this LLM has been shut down"):
        one.generate("x", GREEDY)


def test_chat_is_generate_over_the_chat_template(llm):
    tokenizer = llm.tokenizer
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "why?"}],
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    expected = llm.generate(prompt_token_ids=ids, sampling_params=params)
    chats = llm.chat(conversations, params)
    assert [c.prompt for c in chats] == texts and [c.prompt_token_ids for c in chats] == ids
    assert [c.outputs[0].token_ids for c in chats] == [e.outputs[0].token_ids for e in expected]
    (alone,) = llm.chat(conversations[0], params)  # one conversation
    assert alone.outputs[0].token_ids == expected[0].outputs[0].token_ids
    (continued,) = llm.chat(
        [{"role": "assistant", "content": "The"}], params, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.prompt.endswith("The")
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    (joined,) = llm.chat(parts, params)  # OpenAI's text parts, joined with newlines
    assert joined.prompt == tokenizer.apply_chat_template(
        [{"role": "user", "content": "h\ni"}], add_generation_prompt=True, tokenize=False
    )
    with pytest.raises(ValueError, match="a chat message needs a role"):
        llm.chat([{"content": "hi"}], params)


def test_eos_stops(llm):
    eos = llm.tokenizer.eos_token_id
    # Find a greedy continuation, then declare its 3rd token the EOS by way of stop_token_ids.
    tokens = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[2]]))[0]
    assert out.outputs[0].token_ids == tokens[:3]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == tokens[2]
    assert eos is not None


def test_min_tokens_holds_back_stop_tokens(llm):
    first = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids[0]
    # The greedy first token is a stop token: alone it ends the output at once; min_tokens=4 masks it
    # out of the first four samples, so they are all other tokens and the output runs on.
    stops_at_once = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], ignore_eos=True)
    assert llm.generate(PROMPTS[0], stops_at_once)[0].outputs[0].token_ids == [first]
    held = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=4, ignore_eos=True)
    tokens = llm.generate(PROMPTS[0], held)[0].outputs[0].token_ids
    assert len(tokens) >= 5 and first not in tokens[:4]


def test_min_tokens_with_stop_token_ids_outside_the_vocabulary(llm):
    """A stop token id the model cannot draw has nothing to hold back: the request runs, and the engine lives on."""
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[10**6], ignore_eos=True)
    assert len(llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids) == 4
    assert len(llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids) == 24


def test_a_stop_tokens_text_is_left_out_of_the_output(llm):
    """As vLLM: the token an output stops at (stop_token_ids) is in its token ids, not its text, unless
    include_stop_str_in_output. The output is held to letters (allowed_token_ids) so that each token has text."""
    letters = [llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcde"]
    base = dict(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=letters)
    tokens = llm.generate(PROMPTS[1], SamplingParams(**base))[0].outputs[0].token_ids
    end = tokens.index(tokens[2]) + 1
    out = llm.generate(PROMPTS[1], SamplingParams(**base, stop_token_ids=[tokens[2]]))[0].outputs[0]
    assert out.token_ids == tokens[:end] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(tokens[: end - 1])
    kept = SamplingParams(**base, stop_token_ids=[tokens[2]], include_stop_str_in_output=True)
    assert llm.generate(PROMPTS[1], kept)[0].outputs[0].text == llm.tokenizer.decode(tokens[:end])
    eos = llm.tokenizer.eos_token_id  # EOS alike, its text wanted (skip_special_tokens off) or not
    forced = dict(temperature=0, max_tokens=4, logit_bias={eos: 100.0}, skip_special_tokens=False)
    out = llm.generate(PROMPTS[1], SamplingParams(**forced))[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([eos], "", "stop")
    kept = SamplingParams(**forced, include_stop_str_in_output=True)
    assert llm.generate(PROMPTS[1], kept)[0].outputs[0].text == llm.tokenizer.decode([eos])


def test_temperature_sampling_is_seeded(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[:2], params)[0].outputs[0].token_ids  # other work in the batch
    other = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=16, seed=8, ignore_eos=True))
    assert first == again
    assert first != other[0].outputs[0].token_ids


def test_max_tokens(llm):
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    with_text = llm.generate(PROMPTS, GREEDY)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False, logprobs=2)
    without = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in with_text]
    assert all(o.outputs[0].text == "" and o.outputs[0].finish_reason == "length" for o in without)
    assert all(lp.decoded_token is None for entry in without[0].outputs[0].logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_engines_freeze_what_they_loaded_until_the_last_shuts_down(tiny_llama):
    """A full garbage collection never scans a loaded model (it stalled large-batch steps by 0.1-0.4 s); the
    process's collector and GIL switch interval are as before once no engine runs."""
    before = EngineProcessSettings.running  # engines of other tests (this module's `llm`) may be running
    switch_interval = sys.getswitchinterval()
    first = LLM(tiny_llama, device="cpu", block_size=4)
    second = LLM(tiny_llama, device="cpu", block_size=4)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # the models, tokenizers and their modules
        assert EngineProcessSettings.running == before + 2 and sys.getswitchinterval() <= 1e-4
        second.generate(PROMPTS, GREEDY)
        second.shutdown()
        assert gc.get_freeze_count() > frozen // 2  # `first` still runs: still frozen
    finally:
        first.shutdown()
        second.shutdown()  # a second shutdown changes nothing
    assert EngineProcessSettings.running == before
    assert (gc.get_freeze_count() == 0) == (before == 0)
    assert sys.getswitchinterval() == switch_interval


def test_requests_dropped_with_their_event_loop_leave_the_engine_running(llm):
    """A caller's loop closes while its aborted request still has a step in flight: that step's tokens go nowhere."""
    gate = threading.Event()

    async def first_token() -> None:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        async with contextlib.aclosing(llm.engine.generate(None, params, prompt_token_ids=[5, 6, 7])) as outputs:
            async for _ in outputs:
                # Hold the core until this loop has closed, with the request's next step queued.
                asyncio.ensure_future(llm.engine.call_in_core(lambda core: gate.wait()))
                return  # closing the stream aborts the request

    uvloop.run(first_token())
    gate.set()
    time.sleep(0.5)
    assert llm.engine.is_healthy
    assert len(llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids) == 24


def test_long_prompts_tokenize_off_the_event_loop_to_the_same_ids(llm):
    short, long = "Hello there, world", "lorem ipsum dolor sit amet " * 200
    assert len(long) > TOKENIZE_INLINE_MAX_CHARS >= len(short)

    async def both() -> list[list[int]]:
        return [
            await llm.engine.tokenize(t, add_special_tokens=special) for t in (short, long) for special in (True, False)
        ]

    tokenizer = llm.tokenizer
    expected = [tokenizer.encode(t, add_special_tokens=special) for t in (short, long) for special in (True, False)]
    assert uvloop.run(both()) == expected


def test_a_slow_stream_gets_the_newest_output_not_a_backlog(llm):
    """Steps that pass while the caller is busy merge into the next output it takes; the tokens are the same."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def slow_reader() -> list:
        outputs = []
        async for output in llm.engine.generate(None, params, prompt_token_ids=[5, 6, 7]):
            outputs.append(output)
            await asyncio.sleep(0.2)  # several steps run meanwhile
        return outputs

    outputs = uvloop.run(slow_reader())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert outputs[-1].finished and lengths[-1] == 20
    assert len(outputs) < 20 and max(b - a for a, b in zip([0, *lengths], lengths, strict=False)) > 1
    expected = llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=params)[0].outputs[0].token_ids
    assert outputs[-1].outputs[0].token_ids == expected


def test_tokenize_ignores_a_truncation_the_tokenizer_file_ships_with(tiny_llama, tmp_path):
    model = tmp_path / "truncating"
    shutil.copytree(tiny_llama, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    llm = LLM(model, device="cpu", block_size=4)
    try:
        text = "a fairly long prompt of many bytes"
        assert uvloop.run(llm.engine.tokenize(text)) == llm.tokenizer.encode(text)
        assert len(llm.tokenizer.encode(text)) > 8
    finally:
        llm.shutdown()


def test_an_engine_left_running_is_stopped_by_the_collector_while_another_starts(tiny_llama):
    """An LLM never shut down and reachable only through a reference cycle (a failed test's traceback) is
    freed inside the collection that `engine_started` runs, perhaps while it holds the settings' lock; its
    shutdown takes that lock again on the same thread (it deadlocked the GPU test run after a failure)."""
    before = EngineProcessSettings.running
    leaked = LLM(tiny_llama, device="cpu", block_size=4)
    cycle = [leaked]  # made after the engine froze what it loaded, so the collector frees it
    cycle.append(cycle)
    del leaked, cycle
    finished = threading.Event()

    def collect_holding_the_lock():
        with EngineProcessSettings._lock:  # as a collection triggered inside engine_started would
            gc.collect()
        finished.set()

    threading.Thread(target=collect_holding_the_lock, daemon=True).start()
    assert finished.wait(timeout=60), "the collected engine's shutdown deadlocked on the settings' lock"
    assert EngineProcessSettings.running == before


def _hf_prompt_scores(checkpoint, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF transformers on the same weights: each position's log-softmax row, and the logprob of the token after it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = hf(torch.tensor([prompt_ids])).logits[0, :-1].log_softmax(-1)
    return rows, rows.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]


def test_prompt_logprobs_match_transformers(tiny_llama):
    """Each prompt token's logprob given the ones before, its rank and the top k, as vLLM returns them: the same
    under chunked prefill (5 tokens a step, positions scored across chunks), for a prompt an earlier request left in
    the prefix cache (a scored prompt is computed whole), and for each of n samples."""
    prompt = PROMPTS[3]
    small = LLM(tiny_llama, device="cpu", block_size=4, max_num_batched_tokens=5, max_num_seqs=2)
    try:
        ids = small.tokenizer.encode(prompt)
        small.generate(prompt, SamplingParams(temperature=0, max_tokens=2))  # now in the prefix cache
        params = [SamplingParams(max_tokens=3, prompt_logprobs=2), SamplingParams(max_tokens=3, n=2, prompt_logprobs=0)]
        first, second = small.generate([prompt, prompt], params)
        cached = small.generate(prompt, SamplingParams(max_tokens=1))[0]
    finally:
        small.shutdown()
    rows, expected = _hf_prompt_scores(tiny_llama, ids)
    assert first.metrics.num_cached_tokens == 0 and cached.metrics.num_cached_tokens > 0
    assert len(first.prompt_logprobs) == len(ids) and first.prompt_logprobs[0] is None
    for row, token, want, entry in zip(rows, ids[1:], expected.tolist(), first.prompt_logprobs[1:], strict=True):
        assert next(iter(entry)) == token  # the prompt's token first, then the top 2
        assert entry[token].logprob == pytest.approx(want, abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert entry[token].decoded_token == small.tokenizer.decode([token])
        for rank, top in enumerate(row.topk(2).indices.tolist(), 1):
            assert entry[top].logprob == pytest.approx(row[top].item(), abs=1e-4)
            assert entry[top].rank == rank or top == token
    assert len(first.outputs[0].token_ids) == 3  # and generation goes on as usual
    assert all(len(entry) == 1 for entry in second.prompt_logprobs[1:])  # k = 0: the prompt's token alone
    got = [entry[token].logprob for entry, token in zip(second.prompt_logprobs[1:], ids[1:], strict=True)]
    assert got == pytest.approx(expected.tolist(), abs=1e-4)
    assert len(second.outputs) == 2


def test_prompt_logprobs_over_the_limit_and_negative_are_refused(llm):
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs=21 exceeds"):
        llm.generate("hi", SamplingParams(prompt_logprobs=21))


def test_prompt_logprobs_survive_preemption(tiny_llama):
    """A cache too small for every sequence at once preempts some after their prompts were scored: they are
    recomputed, not scored again, and each request still gets one entry a prompt token."""
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[1] + " again", PROMPTS[3] + " and on"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    tight = LLM(tiny_llama, device="cpu", block_size=4, num_kvcache_blocks=48, max_num_batched_tokens=16)
    try:
        outs = tight.generate(prompts, params)
        assert tight.engine.core.scheduler.num_preemptions > 0
        ids = [tight.tokenizer.encode(p) for p in prompts]
    finally:
        tight.shutdown()
    for out, prompt_ids in zip(outs, ids, strict=True):
        expected = _hf_prompt_scores(tiny_llama, prompt_ids)[1]
        got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt_ids[1:], strict=True)]
        assert len(out.prompt_logprobs) == len(prompt_ids) and got == pytest.approx(expected.tolist(), abs=1e-4)


def test_logit_bias_and_allowed_token_ids(llm):
    """A +100 bias makes greedy pick that token every step, -100 on the greedy token makes it pick another; sampling
    among allowed_token_ids never leaves them; logprobs stay the model's own (vLLM's raw logprobs)."""
    plain = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))[0]
    first = plain.outputs[0].token_ids[0]
    forced = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={7: 100}))
    assert forced[0].outputs[0].token_ids == [7] * 4
    banned = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={first: -100}, logprobs=0)
    other = llm.generate(PROMPTS[1], banned)[0].outputs[0]
    assert other.token_ids[0] != first
    assert other.logprobs[0][other.token_ids[0]].logprob < plain.outputs[0].logprobs[0][first].logprob
    allowed = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=8, ignore_eos=True, allowed_token_ids=[3, 9, 11])
    assert all(set(c.token_ids) <= {3, 9, 11} for c in llm.generate(PROMPTS[0], allowed)[0].outputs)
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list of token ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="logit_bias maps token ids"):
        SamplingParams(logit_bias={"7": 1.0})


def test_chat_with_a_template_of_its_own(llm, tmp_path):
    """vLLM's `LLM.chat(chat_template=...)`: the template itself or its file, in place of the model's."""
    template = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    for source in (template, str(tmp_path / "t.jinja")):
        out = llm.chat(messages, params, chat_template=source)[0]
        assert out.prompt_token_ids == llm.tokenizer("[user: hi]", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="no such file"):
        llm.chat(messages, params, chat_template="missing.jinja")


def test_grammar_compiles_off_the_step_loop(tiny_llama, monkeypatch):
    """A structured output's grammar compiles on a thread of its own: the other requests keep stepping meanwhile;
    the request is scheduled once it has compiled, can be aborted while it compiles, and a grammar the core fails to
    compile refuses its request (`rejected`) without stopping the others."""
    import threading

    from atom_runtime.config import EngineConfig
    from atom_runtime.loading import create_core
    from atom_runtime.sampling_params import InvalidRequestError

    core, _ = create_core(tiny_llama, device="cpu", config=EngineConfig(block_size=4))
    release = threading.Event()
    compile_grammar = core._compile

    def slow_compile(params):
        release.wait(30)
        if params.structured_outputs.regex == "refused":
            raise InvalidRequestError("structured outputs: invalid regex: refused", "structured_outputs")
        return compile_grammar(params)

    monkeypatch.setattr(core, "_compile", slow_compile)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="ab"))
    core.add_request("plain", [1, 2, 3], plain)
    core.add_request("constrained", [4, 5], constrained)
    core.add_request("aborted", [4, 5], constrained)
    core.add_request("refused", [4, 5], SamplingParams(structured_outputs=StructuredOutputsParams(regex="refused")))
    core.abort("aborted")
    tokens: dict[str, list[int]] = {}

    def collect(output) -> None:
        for row, (request_id, token) in enumerate(
            zip(output.request_ids, output.token_ids, strict=True) if output else ()
        ):
            if row not in output.skipped:
                tokens.setdefault(request_id, []).append(token)

    for _ in range(20):  # "plain" runs to its end while the grammars compile
        collect(core.step())
    assert set(tokens) == {"plain"} and len(tokens["plain"]) == 6
    assert core.has_work() and core.stats.num_waiting == 2  # "constrained" and "refused", compiling
    release.set()
    while core.has_work():
        collect(core.step())
    assert core.tokenizer.decode(tokens["constrained"], skip_special_tokens=True) == "ab"
    assert "aborted" not in tokens and "aborted" not in core.sequences
    assert [(request_id, str(error)) for request_id, error in core.rejected] == [
        ("refused", "structured outputs: invalid regex: refused")
    ]
    assert not core.sequences


def test_structured_outputs(llm):
    """vLLM's StructuredOutputsParams: a random model's sampled output still matches a JSON schema, a regex, a
    choice, an EBNF grammar (seeded: the same draws each run); a complete constraint ends the sequence ("stop") even
    under ignore_eos; an invalid one is refused before it runs."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }

    def run(**constraint) -> list[str]:
        params = SamplingParams(
            temperature=1.0, seed=4, n=3, max_tokens=300, structured_outputs=StructuredOutputsParams(**constraint)
        )
        outputs = llm.generate(PROMPTS[1], params)[0].outputs
        assert all(c.finish_reason == "stop" for c in outputs), [c.text for c in outputs]
        return [c.text for c in outputs]

    for text in run(json=schema):
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    assert all(isinstance(json.loads(text), dict) for text in run(json_object=True))
    assert all(re.fullmatch(r"[a-c]{2}[0-9]+", text) for text in run(regex=r"[a-c]{2}[0-9]+"))
    assert set(run(choice=["yes", "no", 'a "quoted" one'])) <= {"yes", "no", 'a "quoted" one'}
    assert all(text in ("up", "down") for text in run(grammar='root ::= "up" | "down"'))
    greedy = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="ab")
    )
    out = llm.generate(PROMPTS[0], greedy)[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))
    # allowed_token_ids that leave nothing the grammar allows: that sequence ends ("abort") without the token the
    # grammar refused, the engine goes on
    z = llm.tokenizer.encode("z", add_special_tokens=False)
    stuck = SamplingParams(allowed_token_ids=z, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    out = llm.generate("x", stuck)[0].outputs[0]
    assert (out.finish_reason, out.token_ids, out.text) == ("abort", [], "")
    stuck_later = SamplingParams(allowed_token_ids=z, structured_outputs=StructuredOutputsParams(regex="z[ab]"))
    out = llm.generate("x", stuck_later)[0].outputs[0]  # "z", then nothing allowed is left
    assert (out.finish_reason, out.text) == ("abort", "z")
    min_tokens = SamplingParams(min_tokens=5, max_tokens=9, structured_outputs=StructuredOutputsParams(choice=["no"]))
    assert llm.generate("x", min_tokens)[0].outputs[0].text == "no"  # where the grammar allows nothing else
    eager_end = {llm.tokenizer.eos_token_id: 100.0}  # EOS as soon as the grammar allows it, but min_tokens first
    regex = StructuredOutputsParams(regex="[ab]+")
    held = SamplingParams(temperature=0, max_tokens=20, min_tokens=6, logit_bias=eager_end, structured_outputs=regex)
    assert len(llm.generate("x", held)[0].outputs[0].text) == 6
    ordered = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}}}
    ordered |= {"required": ["zeta", "alpha"], "additionalProperties": False}
    for text in run(json=ordered):
        assert list(json.loads(text)) == ["zeta", "alpha"]  # the schema's order, as declared
    with pytest.raises(ValueError, match="one constraint, got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])


def test_truncate_prompt_tokens(llm):
    """vLLM's truncate_prompt_tokens: the request runs the prompt's last k tokens (-1: as many as the context holds),
    and says so in prompt_token_ids."""
    ids = llm.tokenizer.encode(PROMPTS[3])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=5)
    (cut,) = llm.generate(prompt_token_ids=ids, sampling_params=params)
    (tail,) = llm.generate(prompt_token_ids=ids[-5:], sampling_params=GREEDY)
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids[:6]
    whole = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=-1)
    assert llm.generate(prompt_token_ids=ids, sampling_params=whole)[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1 or at least 1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_bad_words(llm):
    """vLLM's bad_words: a one-token word is never drawn; a longer one is never completed (its last token is banned
    where the output ends with the rest); the words' token sequences come from the tokenizer (a byte a token here).
    The output is held to five letters (allowed_token_ids) so that the words would come up."""
    letters = {c: llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcde"}
    base = dict(temperature=1.0, seed=7, n=4, max_tokens=40, ignore_eos=True, allowed_token_ids=list(letters.values()))
    free = [c.text for c in llm.generate(PROMPTS[1], SamplingParams(**base))[0].outputs]
    assert any("e" in text for text in free) and any("ab" in text for text in free)  # what the ban must prevent
    banned = [c.text for c in llm.generate(PROMPTS[1], SamplingParams(**base, bad_words=["e", "ab"]))[0].outputs]
    assert all("e" not in text and "ab" not in text and len(text) == 40 for text in banned)
    encode = lambda s: llm.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert tokenize_bad_words([" ab"], encode) == [encode("ab")]  # " ab" is three bytes: not a word-initial form
    word_initial = {"ab": [1, 2], " ab": [3, 2], "cd": [4], " cd": [5, 4]}.get  # a BPE's "ab" and "Ġab"
    assert tokenize_bad_words(["ab", "cd"], word_initial) == [[1, 2], [3, 2], [4]]


def _sample(logits: torch.Tensor, seqs: list, position: int = 1) -> list[int]:
    from atom_runtime.sampler import Draws, Sampler

    draws = Draws(
        torch.tensor([s.params.sample_temperature for s in seqs]),
        torch.tensor([s.sampling_seed for s in seqs]),
        torch.full((len(seqs),), position, dtype=torch.int32),
    )
    return Sampler()(logits, seqs, draws).token_ids.tolist()


def test_a_repetition_penalty_scales_the_logit_bias_too():
    """vLLM's order: logit_bias, then penalties. Token 0 (in the prompt) at 1 + 5 halves to 3, below token 1's 4
    (a bias added after the penalty would give it 5.5)."""
    from atom_runtime.sequence import Sequence

    params = SamplingParams(temperature=0, logit_bias={0: 5.0}, repetition_penalty=2.0)
    assert _sample(torch.tensor([[1.0, 4.0, 0.0]]), [Sequence("r", 0, [0], params)]) == [1]


def test_top_p_takes_its_share_of_what_min_p_leaves():
    """vLLM's order: min-p, then top-k and top-p over what it kept. Min-p 0.5 keeps 0.46 and 0.44, which top-p 0.5
    then cuts to the first (over the whole distribution, 0.46 < 0.5 would keep the second too)."""
    from atom_runtime.sequence import Sequence

    logits = torch.tensor([[0.46, 0.44, 0.10]]).log()
    seq = Sequence("m", 0, [1], SamplingParams(temperature=1.0, min_p=0.5, top_p=0.5, seed=0))
    assert {_sample(logits, [seq], position=p)[0] for p in range(100)} == {0}


def test_a_top_p_of_one_drops_nothing_whatever_the_batch():
    """A row at top_p 1 filtered with a row at top_p 0.9: float32's cumulative sum of a 151,936-token row reaches 1
    before its last 15k tokens (1e-5 of the mass), which must still be drawable, as they are where it is alone."""
    from atom_runtime.sampler import Sampler

    logits = torch.randn(1, 151936, generator=torch.Generator().manual_seed(0)).mul(3).expand(2, -1)
    kept = Sampler._top_p(logits, torch.tensor([1.0, 0.9]))
    assert not kept[0].isneginf().any() and kept[1].isneginf().any()
