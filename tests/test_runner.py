"""The model runner's step inputs: padded decode batches (what CUDA graphs replay) change nothing."""

from __future__ import annotations

import gc
import itertools
import random

import pytest
import torch

from atom_models.ops.sampling import advance_decode_inputs
from atom_models.ops.sampling import carry_tokens_reference as carry
from atom_runtime import LLM, SamplingParams
from atom_runtime.config import EngineConfig
from atom_runtime.scheduler import ScheduledChunk
from atom_runtime.sequence import PLACEHOLDER, Sequence
from atom_runtime.step_inputs import FIELDS, StepInputs, step_layout


@pytest.fixture(scope="module")
def runner(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", block_size=4)
    yield llm.engine.core.runner, llm.engine.core.block_manager
    llm.shutdown()


def prefilled(runner, block_manager, prompts: list[list[int]]) -> list[Sequence]:
    seqs = [Sequence(str(i), 0, p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    chunks = []
    for seq in seqs:
        assert block_manager.allocate(seq, seq.num_tokens)
        chunks.append(ScheduledChunk(seq, 0, seq.num_tokens))
    with torch.inference_mode():
        logits = runner.model.forward(*runner._step_args(*runner.inputs.load(chunks)))
    for seq, token in zip(seqs, logits.argmax(-1).tolist(), strict=True):
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(token)
        assert block_manager.allocate(seq, 1)
    return seqs


def test_padded_decode_step_equals_unpadded(runner):
    runner, block_manager = runner
    seqs = prefilled(runner, block_manager, [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]])
    chunks = [ScheduledChunk(s, s.num_tokens - 1, 1) for s in seqs]
    cache_before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        plain = runner.model.forward(*runner._step_args(*runner.inputs.load(chunks))).clone()
        for c, before in zip(runner.kv_caches, cache_before, strict=True):
            c.copy_(before)
        tokens, num_seqs, logits = runner.inputs.load(chunks, pad_seqs_to=8)
        assert (tokens, num_seqs, logits) == (8, 8, 8)
        padded = runner.model.forward(*runner._step_args(tokens, num_seqs, logits))
    torch.testing.assert_close(padded[:3], plain)
    for seq in seqs:
        block_manager.free(seq)


def test_padded_mixed_step_equals_unpadded(runner):
    """A mixed step laid out as a FULL graph of it reads it (sequences padded with empty ones, tokens with tokens of
    no sequence, logits rows with rows of token 0) gives the same logits for its own rows and writes the same cache."""
    runner, block_manager = runner
    seqs = prefilled(runner, block_manager, [[5, 6, 7, 8, 9], [10, 11]])
    prompt = Sequence("p", 0, [21, 22, 23, 24, 25, 26, 27], SamplingParams(temperature=0))
    assert block_manager.allocate(prompt, 4)
    chunks = [ScheduledChunk(s, s.num_tokens - 1, 1) for s in seqs] + [ScheduledChunk(prompt, 0, 4)]
    cache_before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        plain = runner.model.forward(*runner._step_args(*runner.inputs.load(chunks))).clone()
        cache_plain = [c.clone() for c in runner.kv_caches]
        for c, before in zip(runner.kv_caches, cache_before, strict=True):
            c.copy_(before)
        shape = runner.inputs.load(chunks, pad_seqs_to=4, pad_tokens_to=16, pad_logits_to=4)
        assert shape == (16, 4, 4)
        padded = runner.model.forward(*runner._step_args(*shape))
    assert plain.shape[0] == 2  # the decodes sample; the prompt's chunk does not
    torch.testing.assert_close(padded[:2], plain)
    for c, expected in zip(runner.kv_caches, cache_plain, strict=True):  # a wrong slot would differ by O(1); the
        torch.testing.assert_close(c, expected)  # K/V GEMM at 16 rows rounds unlike at 9 on some CPUs (AVX-512 EPYC)
    for seq in [*seqs, prompt]:
        block_manager.free(seq)


def test_profile_run_holds_the_most_logits_a_step_returns(runner, monkeypatch):
    """The KV budget is what is left after the profile step's peak: it computes a logits row for every sequence a
    step may sample and every prompt position it may score (prompt_logprobs), scores them, and samples the rows
    through the sampler's costliest path (every filter, penalties, a logit bias, logprobs)."""
    from atom_runtime import model_runner
    from atom_runtime.scheduler import PROMPT_LOGPROB_ROWS

    runner, _ = runner
    scored, sampled = [], []
    monkeypatch.setattr(model_runner, "with_logprobs", lambda logits, *_: scored.append(logits.shape))
    sampler = runner.sampler
    monkeypatch.setattr(
        runner, "sampler", lambda logits, seqs, *args: sampled.append(seqs) or sampler(logits, seqs, *args)
    )
    runner.profile_run()
    config, vocab = runner.config, runner.model.config.vocab_size
    rows = min(config.max_num_batched_tokens, config.max_num_seqs + PROMPT_LOGPROB_ROWS)
    assert scored == [(min(rows, PROMPT_LOGPROB_ROWS), vocab)]
    (seqs,) = sampled
    params = seqs[0].params
    assert len(seqs) == min(rows, config.max_num_seqs)
    assert params.needs_penalties and params.shapes_logits and params.filters and params.logprobs


def test_capture_sizes_follow_config():
    assert EngineConfig(max_num_seqs=40).graph_capture_sizes() == [1, 2, 4, 8, 16, 32]
    assert EngineConfig(max_num_batched_tokens=40).piecewise_capture_sizes() == [1, 2, 4, 8, 16, 32]
    assert EngineConfig().piecewise_capture_sizes()[-1] == 512
    for eager in (EngineConfig(enforce_eager=True), EngineConfig(cudagraph_mode="none")):
        assert eager.graph_capture_sizes() == eager.piecewise_capture_sizes() == []
    assert EngineConfig(cudagraph_mode="piecewise").graph_capture_sizes() == []
    assert EngineConfig(cudagraph_mode="full").piecewise_capture_sizes() == []
    assert EngineConfig(cudagraph_mode="full", max_num_batched_tokens=40).mixed_graph_sizes() == [1, 2, 4, 8, 16, 32]
    assert EngineConfig().mixed_graph_sizes() == []  # FULL_AND_PIECEWISE: piecewise graphs for them
    assert EngineConfig(cudagraph_mode="full", enforce_eager=True).mixed_graph_sizes() == []
    assert EngineConfig(cudagraph_capture_sizes=[3, 1, 3]).graph_capture_sizes() == [1, 3]
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        EngineConfig(cudagraph_mode="SOMETIMES")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_equals_eager(tiny_llama):
    """Greedy and seeded draws alike: a decode graph draws the tokens the eager sampler does (top-p rows send
    their whole batch through the sampler's filtering path)."""
    prompts = ["Hello", "The quick brown fox jumps", "a b c"] * 3
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    drawn = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    filtered = [*drawn[:-1], SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)]
    graphed = LLM(tiny_llama, device="cuda", cudagraph_capture_sizes=[1, 2, 4, 8, 16])
    eager = LLM(tiny_llama, device="cuda", enforce_eager=True)
    try:
        assert graphed.engine.core.runner.graphs is not None
        for params in (greedy, drawn, filtered):
            assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == [
                o.outputs[0].token_ids for o in eager.generate(prompts, params)
            ]
    finally:
        graphed.shutdown()
        eager.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_full_graphs_of_mixed_steps_equal_piecewise(tiny_llama):
    """FULL mode: prefill chunks beside decodes replay whole-step graphs of their (tokens, sequences) buckets (the
    attention's tile stream forked and joined inside them) and generate what the default mode's piecewise graphs do
    (which pad the same steps' tokens to the same sizes, so their GEMMs see the same shapes)."""
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog " * 3, "a b c", "x y z " * 5]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sizes = dict(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32], max_num_batched_tokens=32)
    graphed = LLM(tiny_llama, device="cuda", cudagraph_mode="FULL", **sizes)
    piecewise = LLM(tiny_llama, device="cuda", **sizes)
    try:
        graphs = graphed.engine.core.runner.graphs
        replayed, replay = [], graphs.replay
        graphs.replay = lambda key: replayed.append(key) or replay(key)
        assert [o.outputs[0].token_ids for o in graphed.generate(prompts, params)] == [
            o.outputs[0].token_ids for o in piecewise.generate(prompts, params)
        ]
        assert any(key.tokens for key in replayed) and any(key.tokens is None for key in replayed)
    finally:
        graphed.shutdown()
        piecewise.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kv_budget_leaves_room_for_the_graphs_logits(tmp_path):
    """FULL mode's decode and mixed graphs of a 128 k vocabulary would hold ~4 GiB of logits (fp32, a vocabulary
    wide) if each kept its own: they share the pool, so the engine stays within gpu_memory_utilization."""
    from atom_models.checkpoints import make_random_checkpoint

    model = make_random_checkpoint(tmp_path / "wide-vocab", "tiny-llama", vocab_size=128256)
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(model, device="cuda", cudagraph_mode="FULL", max_num_batched_tokens=512, gpu_memory_utilization=0.5)
    try:
        graphs = llm.engine.core.runner.graphs
        rows = sum(logits.shape[0] for logits, _ in graphs.outputs.values())
        assert rows * 128256 * 4 > 3 << 30
        assert total - torch.cuda.mem_get_info()[0] <= 0.5 * total + (1 << 30)
    finally:
        llm.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kv_budget_does_not_count_garbage(tiny_llama):
    """Device memory that only unreachable reference cycles hold (an export in the same process leaves a model's
    weights so, 13 GiB for Llama-3-8B) is the collector's, not in use: the budget runs the collector first."""

    def blocks() -> tuple[int, int]:
        llm = LLM(tiny_llama, device="cuda", enforce_eager=True, gpu_memory_utilization=0.5)
        try:
            return llm.engine.core.runner.num_blocks, llm.engine.core.runner.block_bytes
        finally:
            llm.shutdown()

    clean, block_bytes = blocks()
    gc.disable()  # only the budget's own collection may free the cycle
    try:
        cycle = {"weights": torch.empty(2 << 30, dtype=torch.uint8, device="cuda")}
        cycle["self"] = cycle
        del cycle
        with_garbage, _ = blocks()
    finally:
        gc.enable()
    assert abs(with_garbage - clean) * block_bytes < 1 << 30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_long_prompt_in_chunks_on_an_idle_engine_equals_eager(tiny_llama):
    """One prompt prefilled in many 8-token chunks, nothing else running: chunks that sample nothing let the host
    queue the next step at once, so a host buffer set is refilled while its last copies may still be queued.
    The reference runs the same 8-token steps eagerly and waits for each (a whole-prompt step would have other
    kernels and roundings), so none of its buffers is refilled early."""
    prompt = " ".join(f"w{i}" for i in range(60))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for options in ({"cudagraph_capture_sizes": [1, 2, 4, 8]}, {"enforce_eager": True}):
        llm = LLM(tiny_llama, device="cuda", max_num_batched_tokens=8, num_kvcache_blocks=256, **options)
        try:
            if options.get("enforce_eager"):
                runner = llm.engine.core.runner
                launch = runner.launch

                def launch_and_wait(chunks, in_flight=None, launch=launch):
                    launched = launch(chunks, in_flight)
                    torch.cuda.synchronize()
                    return launched

                runner.launch = launch_and_wait
            assert len(llm.tokenizer.encode(prompt)) > 3 * 8
            tokens.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_launch_never_waits_for_the_device(tiny_llama):
    """Step N+1 is queued while step N runs: nothing in a decode launch may synchronise with the GPU."""
    llm = LLM(tiny_llama, device="cuda", cudagraph_capture_sizes=[1, 2, 4, 8], num_kvcache_blocks=256)
    runner = llm.engine.core.runner
    launch = runner.launch
    checked = []

    def launch_without_syncs(chunks, in_flight=None):
        if not all(c.num_tokens == 1 for c in chunks):
            return launch(chunks, in_flight)
        checked.append(len(chunks))
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(chunks, in_flight)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = launch_without_syncs
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=12, logprobs=2, ignore_eos=True),
    ]
    try:
        outputs = llm.generate(["Hello there", "a b c", "The quick brown fox", "x y"], params)
    finally:
        llm.shutdown()
    assert checked and all(len(o.outputs[0].token_ids) == 12 for o in outputs)


class EmulatedGraph:
    """A CUDA graph's contract on CPU: replay reruns the piece on the very tensors it was captured with.

    So a step that hands a graphed piece anything but what capture saw (a fresh attention output,
    another view) reads stale values, and the outputs differ from the plain forward's.
    """

    def __init__(self, pool) -> None:
        self.fn = self.args = self.outputs = None

    def capture(self, fn, args):
        self.fn, self.args = fn, args
        self.outputs = fn(*args)
        return self.outputs

    def replay(self):
        fresh = self.fn(*self.args)
        for old, new in zip(self.outputs, fresh, strict=True) if isinstance(fresh, tuple) else [(self.outputs, fresh)]:
            old.copy_(new)
        return self.outputs


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation; test_gpu.py serves real piecewise graphs")
@pytest.mark.parametrize("artifact", ["llama_artifact", "qwen3_artifact"])  # Qwen3's cache write norms q and k
def test_piecewise_graphs_equal_plain_forward(artifact, request):
    from atom_runtime.cuda_graphs import PiecewiseGraphs

    prompts = ["Hello there", "The quick brown fox jumps over", "a b c d e f g h i j k", "x"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(request.getfixturevalue(artifact)), block_size=4, max_num_batched_tokens=24)
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner = llm.engine.core.runner
        entries = runner.model.forward.manifest["pieces"]
        reference = PiecewiseGraphs(runner.model.forward, [4], None, EmulatedGraph)  # the torch backend's writes:
        replayed = [n for n, p in vars(runner.model.forward.pieces).items() if hasattr(p, "graphs")]
        assert replayed and not any(entries[n]["kv_cache_op"] for n in replayed)  # eager (a host sync to capture)
        reference.release()
        # (the cache writes run the torch reference here: graphed as on a GPU, whose Triton writes capture)
        piecewise = PiecewiseGraphs(runner.model.forward, [4, 8, 16, 24], None, EmulatedGraph, cache_writes=True)
        calls = runner.model.forward.calls
        assert 0 < piecewise.num_graphed < len(calls)
        assert calls[-1].name not in {n for n, p in vars(runner.model.forward.pieces).items() if hasattr(p, "graphs")}
        piecewise.capture(runner, progress=False)
        runner.piecewise = piecewise
        # chunked prefill (24-token budget) and mixed prefill + decode steps, padded to 4, 8, 16 or 24 tokens
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        graphed = {n: p for n, p in vars(runner.model.forward.pieces).items() if hasattr(p, "graphs")}
        assert all(set(p.graphs) == {4, 8, 16, 24} for p in graphed.values())
        kv_ops = [c.name for c in calls if entries[c.name]["kv_cache_op"]]  # a cache write, then attention, a layer
        assert {n for n in kv_ops if n in graphed} == set(kv_ops[0::2])  # the cache writes replay; attention does not
        piecewise.release()
    finally:
        llm.shutdown()


def test_step_inputs_wait_for_a_host_set_copies_before_refilling_it():
    """A host buffer set is refilled only after the copies made from it have run: load waits on the set's event
    before writing it and records the event after queueing its copies (steps that sample nothing do not hold the
    host back, so without the wait it could overwrite a set whose copies are still queued)."""
    inputs = StepInputs(max_tokens=16, max_seqs=2, max_blocks_per_seq=2, block_size=8, device=torch.device("cpu"))
    seq = Sequence("s", 0, list(range(6)), SamplingParams())
    seq.block_table = [3, 4]
    calls: list[tuple[str, list[int]]] = []
    positions = inputs.fields(2, 1, 1)[1][0]["positions"]  # both steps' shape: 2 tokens, 1 sequence, 1 sample

    class Event:  # records what the host set held when the runtime waited on, then re-armed, the event
        def synchronize(self):
            calls.append(("wait", positions.tolist()))

        def record(self):
            calls.append(("record", positions.tolist()))

    inputs.copied = [Event()]
    inputs.load([ScheduledChunk(seq, 0, 2)])
    inputs.load([ScheduledChunk(seq, 2, 2)])
    assert calls == [("wait", [0, 0]), ("record", [0, 1]), ("wait", [0, 1]), ("record", [2, 3])]


def test_step_layout_packs_fields_aligned_with_per_token_ones_first():
    """A step's fields share one buffer (one copy a step), each 16-byte aligned as a tensor of its own would be
    (kernels specialise on it); the per-token ones come first, placed by the token count alone (piecewise graphs
    replay over them whatever the batch's sequences), and a step of the same counts finds them where they were."""
    fields, size = step_layout(5, 3, 2)
    assert all(offset % 16 == 0 for offset, _ in fields.values())
    assert [fields[name][0] for name in ("input_ids", "positions", "slot_mapping")] == [0, 48, 96]
    for seqs, logits in [(1, 1), (7, 0)]:
        other = step_layout(5, seqs, logits)[0]
        assert all(other[name] == fields[name] for name in ("input_ids", "positions", "slot_mapping"))
    dtypes = {name: dtype for name, dtype, _ in FIELDS}
    spans = sorted((offset, offset + n * dtypes[name].itemsize) for name, (offset, n) in fields.items())
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert spans[-1][1] <= size
    assert fields["query_start_loc"][1] == 4 and fields["temperature"][1] == 2


def test_step_inputs_copy_the_fields_in_one_copy_and_only_changed_table_rows():
    """With device buffers of their own (as on a GPU), the device holds every step's inputs after one copy of the
    packed fields, and block-table rows whose table is unchanged are not copied again."""
    inputs = StepInputs(32, 4, 8, block_size=8, device=torch.device("cpu"), device_buffers=True)
    copied: list[tuple[int, int]] = []
    copy_tables = inputs._copy_tables
    inputs._copy_tables = lambda lo, hi: (copied.append((lo, hi)), copy_tables(lo, hi))
    seqs = [Sequence(f"s{i}", 0, list(range(5 + i)), SamplingParams()) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [10 * i, 10 * i + 1]

    def step(chunks, pad=None):
        copied.clear()
        shape = inputs.load(chunks, pad_seqs_to=pad)
        device, hosts = inputs.fields(*shape)
        host = hosts[(inputs.turn - 1) % len(hosts)]
        for name, values in device.items():
            assert values.tolist() == host[name].tolist(), name
        assert torch.equal(inputs.block_tables[: shape[1]], inputs.host_blocks[0][: shape[1]])
        return list(copied)

    def decode(seq):
        seq.token_ids.append(len(seq.token_ids))
        return ScheduledChunk(seq, len(seq.token_ids) - 1, 1)

    assert step([ScheduledChunk(seq, 0, len(seq.token_ids)) for seq in seqs]) == [(0, 3)]  # prefill
    assert step([decode(seq) for seq in seqs]) == []
    seqs[1].block_table.append(11)  # one table grows: its row alone
    assert step([decode(seq) for seq in seqs]) == [(1, 2)]
    seqs[0].block_table = [30, 31, 32]  # one is replaced, and the last sequence leaves (padding takes its row)
    assert step([decode(seq) for seq in seqs[:2]], pad=3) == [(0, 3)]
    assert step([decode(seq) for seq in seqs[:2]], pad=3) == []


def test_step_inputs_find_tokens_a_decode_graph_drew_in_place(monkeypatch):
    """A decode graph draws into its input ids: the next decode step of the batch, each sequence in its row (or
    rows leaving from the end), copies the other fields only and carries nothing; a step whose rows moved puts the
    drawn tokens aside before its upload overwrites them, then carries them."""
    inputs = StepInputs(32, 4, 8, block_size=8, device=torch.device("cpu"), device_buffers=True)
    carries = []
    monkeypatch.setattr("atom_runtime.step_inputs.carry_tokens", lambda *args: (carries.append(args), carry(*args)))
    seqs = [Sequence(f"s{i}", 0, [5, 6, 7], SamplingParams()) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]

    def decode(batch: list[Sequence], in_flight: torch.Tensor, rows_before: list[int]) -> torch.Tensor:
        """One decode step whose tokens are `in_flight[rows_before]`; returns its input ids, with the tokens a
        graph would draw into them."""
        expected = in_flight[rows_before].tolist()
        for seq, row in zip(batch, rows_before, strict=True):
            seq.token_ids.append(PLACEHOLDER)
            seq.sample_row = row
        shape = inputs.load([ScheduledChunk(seq, len(seq.token_ids) - 1, 1) for seq in batch], in_flight=in_flight)
        fields = inputs.fields(*shape)[0]
        assert fields["input_ids"].tolist() == expected
        assert fields["positions"].tolist() == [len(seq.token_ids) - 1 for seq in batch]
        for seq, token in zip(batch, expected, strict=True):
            seq.token_ids[-1] = token
        return draw_as_a_decode_graph(inputs, shape)

    drawn = decode(seqs, torch.tensor([41, 42, 43]), [0, 1, 2])  # another step's samples: carried
    assert len(carries) == 1
    for _ in range(2):  # the same batch: in place, and its fields moved on by the draw: nothing copied
        drawn = decode(seqs, drawn, [0, 1, 2])
    assert inputs.skipped_uploads == 2
    drawn = decode(seqs[:2], drawn, [0, 1])  # the last sequence left: still in place, but fields to copy
    assert len(carries) == 1 and inputs.skipped_uploads == 2
    decode(seqs[1:2], drawn, [1])  # the first left: the second's token moves from row 1 to row 0
    assert len(carries) == 2 and carries[-1][3].data_ptr() == inputs.in_flight_copy.data_ptr()


def draw_as_a_decode_graph(inputs: StepInputs, shape: tuple[int, int, int]) -> torch.Tensor:
    """What a decode graph's draw does to its step's fields (`FullGraphs`): random tokens into its input ids,
    returned, and its positions, slots, lengths and draw positions one token on (`sample_rows`' `advance`)."""
    fields = inputs.fields(*shape)[0]
    advance_decode_inputs(fields["sample_positions"], (fields["positions"], fields["slot_mapping"], fields["seq_lens"]))
    inputs.graph_drew(shape[1])
    return fields["input_ids"].copy_(torch.randint(100, 200, fields["input_ids"].shape))


def test_step_inputs_of_a_steady_decode_batch_copy_nothing():
    """A decode batch that a graph ran finds its next step's fields on the device, moved on by the draw: nothing
    is copied, until a sequence crosses into a new block (its slot is not the last one's + 1), leaves or joins."""
    inputs = StepInputs(32, 4, 8, block_size=8, device=torch.device("cpu"), device_buffers=True)
    seqs = [Sequence(f"s{i}", 0, [5] * (3 + 2 * i), SamplingParams()) for i in range(2)]
    for i, seq in enumerate(seqs):
        seq.block_table = [10 * i, 10 * i + 5]  # a block's next slot is not its last + 1
    drawn, copies = None, []
    for step in range(12):
        batch = seqs if step < 10 else seqs[:1]  # the second sequence leaves for the last two steps
        for seq in batch:
            seq.token_ids.append(PLACEHOLDER if drawn is not None else 1)
            seq.sample_row = batch.index(seq)
        before = inputs.skipped_uploads
        shape = inputs.load([ScheduledChunk(seq, len(seq.token_ids) - 1, 1) for seq in batch], in_flight=drawn)
        copies.append(inputs.skipped_uploads == before)
        fields = inputs.fields(*shape)[0]
        assert fields["positions"].tolist() == [len(seq.token_ids) - 1 for seq in batch]
        assert fields["slot_mapping"].tolist() == [
            seq.block_table[(len(seq.token_ids) - 1) // 8] * 8 + (len(seq.token_ids) - 1) % 8 for seq in batch
        ]
        assert fields["seq_lens"].tolist() == [len(seq.token_ids) for seq in batch]
        assert inputs.draws(len(batch)).positions.tolist() == [len(seq.token_ids) for seq in batch]
        drawn = draw_as_a_decode_graph(inputs, shape)
        for seq, token in zip(batch, drawn.tolist(), strict=False):
            seq.token_ids[-1] = token
    # copied: the first step, the first in place (its carry rows), the ones where a sequence's position reaches 8 (a
    # new block: s1 at step 3, s0 at step 5), the one where s1 left (another shape); none else
    assert [step for step, copied in enumerate(copies) if copied] == [0, 1, 3, 5, 10]


def test_step_inputs_copy_block_table_rows_in_runs():
    """Changed block-table rows far apart (long rows: 64 KB each here) are copied as separate runs, not as one copy
    over every row between them; near ones share a copy."""
    inputs = StepInputs(8, 6, 16384, block_size=8, device=torch.device("cpu"), device_buffers=True)
    copied: list[tuple[int, int]] = []
    copy_tables = inputs._copy_tables
    inputs._copy_tables = lambda lo, hi: (copied.append((lo, hi)), copy_tables(lo, hi))
    seqs = [Sequence(f"s{i}", 0, [1, 2], SamplingParams()) for i in range(6)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]
    chunks = [ScheduledChunk(seq, 1, 1) for seq in seqs]
    inputs.load(chunks)
    assert copied == [(0, 6)]
    copied.clear()
    for i in (0, 1, 4):
        seqs[i].block_table.append(10 + i)
    inputs.load(chunks)
    assert copied == [(0, 2), (4, 5)]
    assert torch.equal(inputs.block_tables[:6], inputs.host_blocks[0][:6])


@pytest.mark.parametrize("host_sets", [1, 2])
def test_step_inputs_random_schedules_reach_the_device(host_sets):
    """Random steps against an independently computed expectation of what the device must hold: sequences that
    change rows, grow or replace their tables, get preempted (tables emptied), prefill in chunks, decode with
    tokens still on the device (carried), padded batches and padded tokens, both write paths (few and many
    sequences), with device buffers of their own and one or two host sets."""
    rng = random.Random(host_sets)
    block_size, max_blocks, max_seqs, max_tokens = 4, 16, 48, 256
    cpu = torch.device("cpu")
    inputs = StepInputs(max_tokens, max_seqs, max_blocks, block_size, cpu, host_sets=host_sets, device_buffers=True)
    blocks = itertools.count(1000)
    seqs = [
        Sequence(
            f"s{i}",
            0,
            [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))],
            SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0])),
        )
        for i in range(60)
    ]
    computed = dict.fromkeys(seqs, 0)
    drawn_into = None  # the last step's input ids, where a decode graph would have drawn its tokens
    chunks, pad_seqs, steady_steps = [], None, 0
    for _ in range(400):
        # after a decode graph, often the same batch a token on, each sequence in its row (a steady batch)
        steady = drawn_into is not None and rng.random() < 0.8
        steady = steady and all(len(c.seq.token_ids) < max_blocks * block_size for c in chunks)
        if steady:
            steady_steps += 1
            keep = len(chunks) if rng.random() < 0.7 else rng.randint(1, 3)  # or rows leave from the end
            for chunk in chunks[:keep]:
                chunk.seq.token_ids.append(rng.randrange(1, 50))
                if (chunk.start + 1) // block_size == len(chunk.seq.block_table):
                    chunk.seq.block_table.append(next(blocks))
            chunks = [ScheduledChunk(c.seq, c.start + 1, 1) for c in chunks[:keep]]
        for seq in seqs if not steady else ():
            if rng.random() < 0.03 or len(seq.token_ids) >= max_blocks * block_size:  # preempted: starts over
                seq.block_table, computed[seq] = [], 0
                seq.token_ids = seq.token_ids[:5]
        if not steady:
            chunks, budget = [], max_tokens - 8
        for seq in rng.sample(seqs, rng.randrange(1, max_seqs - 4)) if not steady else ():
            if computed[seq] == len(seq.token_ids):
                seq.token_ids.append(rng.randrange(1, 50))
            n = min(len(seq.token_ids) - computed[seq], rng.choice([1, 1, 3, 8]))
            if n > budget:
                continue
            budget -= n
            grow = [next(blocks) for _ in range(-(-(computed[seq] + n) // block_size) - len(seq.block_table))]
            if rng.random() < 0.3:
                seq.block_table = seq.block_table + grow  # replaced
            else:
                seq.block_table.extend(grow)
            chunks.append(ScheduledChunk(seq, computed[seq], n))
        in_flight, carrying = torch.randint(100, 200, (max_seqs,)), 0.3
        if drawn_into is not None and (steady or rng.random() < 0.5):  # a decode graph drew (and moved fields on)
            in_flight, carrying = draw_as_a_decode_graph(inputs, inputs.shape)[: drawn_into.shape[0]], 0.9
        drawn = in_flight.clone()  # what the step takes, before its upload may overwrite it
        known = {}  # tokens the host learns once the step has run
        for row, chunk in enumerate(chunks):
            last = chunk.start + chunk.num_tokens - 1
            if last == len(chunk.seq.token_ids) - 1 and (steady or rng.random() < carrying):
                # its row in the step before: mostly the same, as in a steady batch
                before = (
                    row if steady or (row < len(in_flight) and rng.random() < 0.8) else rng.randrange(len(in_flight))
                )
                known[chunk.seq] = (last, int(drawn[before]))
                chunk.seq.token_ids[last], chunk.seq.sample_row = PLACEHOLDER, before
        decode_only = all(c.num_tokens == 1 for c in chunks)
        if not steady:  # padded as a decode graph's step, or (not decode only) as a mixed step's graph
            pad_seqs = len(chunks) + rng.randrange(0, 5) if rng.random() < 0.5 else None
        num_tokens, pad_logits = sum(c.num_tokens for c in chunks), None
        pad_tokens = None if steady or pad_seqs or rng.random() < 0.7 else num_tokens + rng.randrange(6)
        if pad_seqs and not decode_only:
            pad_tokens = num_tokens + rng.randrange(4)
            pad_logits = min(pad_seqs, max_seqs) + rng.randrange(3)
        shape = inputs.load(
            chunks,
            pad_seqs_to=pad_seqs and min(pad_seqs, max_seqs),
            in_flight=in_flight,
            pad_tokens_to=pad_tokens,
            pad_logits_to=pad_logits,
        )
        # a step a decode graph could run: one token a sequence, each sampled (padded with sequences, if at all)
        graph_step = decode_only and shape[0] == shape[1] == shape[2]
        drawn_into = inputs.fields(*shape)[0]["input_ids"][: len(chunks)] if graph_step else None
        ids, positions, slots, lens, starts = [], [], [], [], [0]
        for chunk in chunks:
            seq = chunk.seq
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                token = seq.token_ids[p]
                ids.append(int(drawn[seq.sample_row]) if token == PLACEHOLDER else token)
                positions.append(p)
                slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
            lens.append(chunk.start + chunk.num_tokens)
            starts.append(len(ids))
        device = inputs.fields(*shape)[0]
        assert device["input_ids"][: len(ids)].tolist() == ids
        assert device["positions"][: len(ids)].tolist() == positions
        assert device["slot_mapping"][: len(ids)].tolist() == slots
        assert device["seq_lens"][: len(chunks)].tolist() == lens
        assert device["query_start_loc"][: len(starts)].tolist() == starts
        for row, chunk in enumerate(chunks):
            assert inputs.block_tables[row, : len(chunk.seq.block_table)].tolist() == chunk.seq.block_table
        if pad_seqs:  # sequences right after the step's own (one token each, or none in a mixed step's graph)
            padded = min(pad_seqs, max_seqs)
            pad = padded - len(chunks)
            each = 0 if pad_tokens else 1
            assert not inputs.block_tables[len(chunks) : padded].any()
            assert device["slot_mapping"][len(ids) :].eq(-1).all()
            assert device["seq_lens"][len(chunks) : padded].eq(1).all()
            ends = [len(ids) + each * (i + 1) for i in range(pad)]
            assert device["query_start_loc"][len(starts) :].tolist() == ends
            sampled_rows = sum(c.samples for c in chunks)
            rows = list(range(len(ids), len(ids) + pad)) if each else [0] * pad
            assert device["logits_indices"][sampled_rows : sampled_rows + pad].tolist() == rows
            shape_tokens = max(len(ids) + each * pad, pad_tokens or 0)
            assert shape == (shape_tokens, padded, max(sampled_rows + pad, pad_logits or 0))
            assert not device["logits_indices"][sampled_rows + pad :].any()  # rows of token 0
        sampled = [starts[row + 1] - 1 for row, chunk in enumerate(chunks) if chunk.samples]
        assert device["logits_indices"][: len(sampled)].tolist() == sampled
        drawing = [chunk for chunk in chunks if chunk.samples]
        temperature, seeds, draw_positions = inputs.draws(len(drawing))
        assert temperature.tolist() == [c.seq.params.sample_temperature for c in drawing]
        assert seeds.tolist() == [c.seq.sampling_seed for c in drawing]
        assert draw_positions.tolist() == [c.start + c.num_tokens for c in drawing]
        if pad_seqs:  # padding's logits rows: greedy
            padding = min(pad_seqs, max_seqs) - len(chunks)
            assert not device["temperature"][len(drawing) : len(drawing) + padding].any()
        for seq, (last, token) in known.items():
            seq.token_ids[last] = token
        for chunk in chunks:
            computed[chunk.seq] = chunk.start + chunk.num_tokens
    # steady steps often found their fields on the device already (crossing no block, a padded row's none)
    assert steady_steps > 50 and inputs.skipped_uploads > steady_steps // 4


def sample(logits: torch.Tensor, seqs: list[Sequence], drawn: torch.Tensor | None = None, position: int = 1):
    from atom_runtime.sampler import Draws, Sampler

    draws = Draws(
        torch.tensor([s.params.sample_temperature for s in seqs]),
        torch.tensor([s.sampling_seed for s in seqs]),
        torch.full((len(seqs),), position, dtype=torch.int32),
    )
    return Sampler()(logits, seqs, draws, drawn).token_ids.tolist()


def test_sampler_takes_a_steps_draws_only_over_unchanged_unfiltered_logits():
    """A decode graph's tokens are the batch's samples, unless penalties or min_tokens changed the logits or a row
    filters them."""
    logits = torch.tensor([[0.0, 3.0, 2.0], [2.0, 0.0, 1.0]])
    given = torch.tensor([0, 1])  # not the argmax: shows where the sampler's answer came from
    plain = [Sequence(str(i), 0, [1], SamplingParams(temperature=0)) for i in range(2)]
    assert sample(logits, plain, given) == [0, 1]
    assert sample(logits, plain) == [1, 0]
    hot = [Sequence(str(i), 0, [1], SamplingParams(temperature=1.0)) for i in range(2)]
    assert sample(logits, hot, given) == [0, 1]
    penalised = [Sequence(str(i), 0, [1], SamplingParams(temperature=0, repetition_penalty=2.0)) for i in range(2)]
    assert sample(logits, penalised, given) == [2, 0]  # token 1's 3 halved: recomputed
    mixed = [plain[0], Sequence("s", 0, [1], SamplingParams(temperature=1.0, top_k=1))]  # top-k 1: its argmax
    assert sample(logits, mixed, given) == [1, 0]


def test_a_row_drawn_again_after_a_decode_graph_draws_at_the_graphs_positions():
    """A decode graph's draw moves the draw positions one on (`sample_rows`' `advance`): a row the sampler draws
    again (filtered, penalised) must draw as the same row drawn outside a graph at the positions before the move."""
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 3
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=1),
        SamplingParams(temperature=0.8, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=3),
    ]
    for i in range(2):  # the rows drawn again: filtered, penalised
        seqs = [Sequence(str(i), 0, [1, 2], p) for p in (params[i], params[2])]
        eager = sample(logits[[i, 2]], seqs, position=40)
        graph_drawn = torch.tensor([7, sample(logits[[2]], seqs[1:], position=40)[0]])
        assert sample(logits[[i, 2]], seqs, graph_drawn, position=41) == eager
        assert sample(logits[[i, 2]], seqs, graph_drawn, position=40) != eager  # (the positions do matter)


def test_greedy_rows_of_a_sampled_batch_take_the_first_of_equal_largest_logits():
    """As torch.argmax and the decode graphs do, whatever top-p's (unstable) sort does with the ties."""
    logits = torch.zeros(2, 64)
    logits[0, [5, 9, 30]] = 4.0
    rows = [
        Sequence("greedy", 0, [1], SamplingParams(temperature=0, top_p=0.2)),
        Sequence("random", 0, [1], SamplingParams(temperature=1.0, top_p=0.9)),
    ]
    assert all(sample(logits, rows, position=p)[0] == 5 for p in range(20))


def test_a_seeded_draw_depends_on_its_seed_and_position_alone():
    """Not on the rows around it, nor on whether a filter sent the batch through the filtering path (a top-k that
    keeps every token); another position draws anew."""
    logits = torch.randn(3, 500)
    params = SamplingParams(temperature=0.9, seed=11)
    seeded = Sequence("seeded", 0, [1], params)
    others = [Sequence(str(i), 0, [1], SamplingParams(temperature=1.3)) for i in range(2)]
    alone = sample(logits[1:2], [seeded], position=40)
    assert sample(logits, [others[0], seeded, others[1]], position=40)[1] == alone[0]
    keep_all = Sequence("filtered", 0, [1], SamplingParams(temperature=1.0, top_k=500))
    assert sample(logits, [keep_all, seeded, others[1]], position=40)[1] == alone[0]
    again = Sequence("seeded", 0, [1], SamplingParams(temperature=0.9, seed=11))
    assert sample(logits[1:2], [again], position=40) == alone
    assert [sample(logits[1:2], [seeded], position=p)[0] for p in range(41, 49)] != alone * 8


def test_decode_graph_keys():
    """A lone decode whose context fits SHORT_CONTEXT replays the short batch-1 graph (the block tables' first
    columns, a view with the full rows' stride); longer ones, batches, and engines without a batch-1 graph or
    with tables no wider than it take the graphs by size; prefill chunks none."""
    from types import SimpleNamespace

    from atom_runtime.cuda_graphs import SHORT_CONTEXT, FullGraphs, GraphKey

    def graphs(sizes: list[int], max_blocks: int) -> FullGraphs:
        runner = SimpleNamespace(inputs=StepInputs(64, 8, max_blocks, 16, torch.device("cpu")))
        return FullGraphs(runner, sizes, pool=None)

    def decodes(*contexts: int) -> list[ScheduledChunk]:
        seqs = [Sequence(f"s{i}", 0, [1] * n, SamplingParams()) for i, n in enumerate(contexts)]
        return [ScheduledChunk(s, len(s.token_ids) - 1, 1) for s in seqs]

    wide = graphs([1, 2, 4], 4 * SHORT_CONTEXT // 16)
    short = GraphKey(1, SHORT_CONTEXT // 16)
    assert wide.capture_keys() == [GraphKey(4), GraphKey(2), GraphKey(1), short]
    assert wide.key_for(decodes(SHORT_CONTEXT)) == short  # its keys, the new token's included, fit
    assert wide.key_for(decodes(SHORT_CONTEXT + 1)) == GraphKey(1)
    assert wide.key_for(decodes(10, 20, 30)) == GraphKey(4)
    assert wide.key_for(decodes(10, 20, 30, 40, 50)) is None
    prompt = Sequence("p", 0, [1] * 8, SamplingParams())
    assert wide.key_for([ScheduledChunk(prompt, 0, 8)]) is None
    assert graphs([2, 4], 4 * SHORT_CONTEXT // 16).capture_keys() == [GraphKey(4), GraphKey(2)]
    assert graphs([1, 2], SHORT_CONTEXT // 16).key_for(decodes(100)) == GraphKey(1)  # the table is no wider
    assert graphs([1], 2 * SHORT_CONTEXT // 16 - 1).capture_keys() == [GraphKey(1)]  # nor twice as wide: a launch alike
    inputs = wide.runner.inputs
    tables = inputs.views(1, 1, 1, short.table_blocks)[2].block_tables
    assert tables.shape == (1, short.table_blocks) and tables.stride(0) == inputs.block_tables.shape[1]


def test_mixed_graph_keys():
    """In FULL mode a prefill or mixed step takes a graph of its sequences padded to a bucket (with empty ones) and
    its tokens to a token size past the bucket's count; not a step that scores prompt positions, nor one past the
    largest sizes. Every (tokens, sequences) pair is captured, largest first."""
    from types import SimpleNamespace

    from atom_runtime.cuda_graphs import FullGraphs, GraphKey

    runner = SimpleNamespace(inputs=StepInputs(512, 64, 8, 16, torch.device("cpu")))
    graphs = FullGraphs(runner, [1, 2, 4, 8], pool=None, mixed_tokens=[8, 32, 128, 512])
    assert graphs.mixed_seqs == [4, 16, 64]
    keys = graphs.capture_keys()
    assert keys[:3] == [GraphKey(64, None, 512), GraphKey(16, None, 512), GraphKey(4, None, 512)]
    assert {k for k in keys if k.tokens == 8} == {GraphKey(4, None, 8)} and GraphKey(8) in keys

    def step(*lens: int) -> list[ScheduledChunk]:
        seqs = [Sequence(f"s{i}", 0, [1] * (n + 3), SamplingParams()) for i, n in enumerate(lens)]
        return [ScheduledChunk(s, 3, n) for s, n in zip(seqs, lens, strict=True)]

    assert graphs.key_for(step(8)) == GraphKey(4, None, 8)  # 3 empty padding sequences take no tokens
    assert graphs.key_for(step(9)) == GraphKey(4, None, 32)
    assert graphs.key_for(step(1, 2)) == GraphKey(4, None, 8)  # 3 tokens, but more than the 4 sequences
    assert graphs.key_for(step(1, 1, 1, 1, 20)) == GraphKey(16, None, 32)  # 24 tokens, 11 padding sequences
    assert graphs.key_for(step(*[1] * 15, 2)) == GraphKey(16, None, 32)  # 17 tokens: more than 16 sequences
    assert graphs.key_for(step(*[1] * 20, 5)) == GraphKey(64, None, 128)  # 25 tokens, but more than 64 sequences
    assert graphs.key_for(step(512)) == GraphKey(4, None, 512)
    assert graphs.key_for(step(513)) is None  # past the largest size: outside the graphs
    assert graphs.key_for(step(1, 1, 1)) == GraphKey(4)  # decodes: the decode graphs
    assert graphs.key_for(step(*[2] * 65)) is None  # more sequences than the largest bucket
    scored = step(7)
    scored[0].scored = range(3, 9)
    assert graphs.key_for(scored) is None  # prompt_logprobs: their rows are the piecewise path's
    for lens in ([8], [1, 2], [*[1] * 15, 2], [*[1] * 20, 5], [512], [1, 1, 1], [3] * 60):
        assert graphs.key_for(step(*lens)) in keys  # every key a step takes is one captured
    decode_only = FullGraphs(runner, [1, 2, 4, 8], pool=None)
    assert decode_only.key_for(step(5)) is None and all(k.tokens is None for k in decode_only.capture_keys())
