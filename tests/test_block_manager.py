"""Paged blocks with prefix caching: chained hashes, reference counts, LRU eviction."""

from __future__ import annotations

from atom_runtime.block_manager import BlockManager, block_hash
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.scheduler import ScheduledChunk, Scheduler
from atom_runtime.sequence import PLACEHOLDER, Sequence


def seq(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, 0, tokens, SamplingParams())


def run_prompt(bm: BlockManager, s: Sequence) -> None:
    prefix = bm.cached_prefix(s)
    assert bm.allocate(s, s.num_tokens - len(prefix) * bm.block_size, prefix)
    s.num_computed_tokens = s.num_tokens


def step(sched: Scheduler, token: int = 7) -> list[ScheduledChunk]:
    """One engine step whose sampled tokens are known at once (what `EngineCore._commit` and `_finish_in_flight` do)."""
    chunks = sched.schedule().chunks
    for c in chunks:
        c.seq.num_computed_tokens = c.start + c.num_tokens
        if c.samples:
            c.seq.token_ids.append(token)
            if c.seq.num_tokens >= c.seq.max_num_tokens:
                sched.finish(c.seq, "length")
    return chunks


def test_hashes_chain_on_the_prefix():
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [0, 0]), [1, 2])
    assert block_hash(7, [1, 2, 3]) == block_hash(7, [1, 2, 3])


def test_shared_prefix_hits_full_blocks_only_and_leaves_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(list(range(10)), "a")
    run_prompt(bm, first)
    second = seq(list(range(9)) + [99, 100], "b")  # shares 9 tokens: two full blocks
    assert bm.cached_prefix(second) == first.block_table[:2]
    exact = seq(list(range(8)), "c")  # all 8 tokens cached, but the last must be computed
    assert bm.cached_prefix(exact) == first.block_table[:1]
    run_prompt(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert bm.ref_counts[first.block_table[0]] == 2
    assert second.num_computed_tokens == second.num_tokens


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5], "a")
    run_prompt(bm, a)  # 3 blocks, 2 of them full and hashed
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = seq([1, 2, 3, 4, 9], "again")
    assert bm.cached_prefix(again) == a_blocks[:2]  # still cached after the free
    b = seq([7, 8, 9, 10, 11, 12, 13], "b")  # needs all 4 blocks: evicts the cached ones
    run_prompt(bm, b)
    assert bm.cached_prefix(again) == []
    assert bm.num_free_blocks == 0


def test_cache_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_prompt(bm, seq([1, 2, 3, 4, 5], "a"))
    assert bm.cached_prefix(seq([1, 2, 3, 4, 6], "b")) == []


def test_blocks_holding_unsampled_tokens_are_not_hashed():
    bm = BlockManager(num_blocks=8, block_size=2)
    s = seq([1, 2, 3], "a")
    run_prompt(bm, s)
    s.token_ids.append(PLACEHOLDER)  # the second block fills with a token still on the device
    assert bm.allocate(s, 1)
    s.num_computed_tokens = 4
    assert len(s.block_hashes) == 1
    s.token_ids[-1] = 4
    s.token_ids.append(PLACEHOLDER)
    assert bm.allocate(s, 1)  # next step: the filled block is hashed now that its tokens are known
    assert len(s.block_hashes) == 2
    assert bm.cached_prefix(seq([1, 2, 3, 4, 5], "b")) == s.block_table[:2]


def test_a_prompt_preempted_mid_prefill_does_not_count_its_own_blocks_as_cache_hits():
    """`b` grows into the block `a`'s next chunk needs: `a` is preempted after one chunk of its prompt, and resumes
    from the block it hashed itself. That is no prefix-cache hit of its prompt (vLLM counts only the first lookup)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=3)
    b = Sequence("b", 0, [1, 2], SamplingParams(max_tokens=3))
    a = Sequence("a", 0, list(range(10, 16)), SamplingParams(max_tokens=1))
    sched.add(b)
    sched.add(a)
    while sched.has_work():
        step(sched)
    assert sched.num_preemptions == 1 and a.finished and a.num_tokens == 7
    assert a.num_cached_tokens == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (2 + 6, 0)


def test_a_sibling_is_admitted_on_the_prefix_blocks_its_sibling_holds():
    """n > 1: once one sample has prefilled a long prompt, another needs one new block, not the prompt's 60 again (the
    admission's watermark counted the held prefix blocks as taken from the free pool, so it waited with 39 free)."""
    bm = BlockManager(num_blocks=100, block_size=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=256)
    prompt = list(range(1000, 1120))
    first = Sequence("r", 0, prompt, SamplingParams(max_tokens=4))
    sched.add(first)
    step(sched)
    second = Sequence("r", 1, prompt, SamplingParams(max_tokens=4))
    sched.add(second)
    free = bm.num_free_blocks
    assert [(c.seq, c.num_tokens) for c in step(sched)] == [(first, 1), (second, 2)]
    assert bm.num_free_blocks == free - 2 and second.num_cached_tokens == 118  # a block each: 121st token, 2 new
