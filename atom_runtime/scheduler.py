"""Continuous batching: which tokens of which sequences run in the next step.

Every step has a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Running sequences go first, in arrival order: a decode costs one
token, an unfinished prompt takes the next chunk that fits the budget (chunked
prefill), so prefill chunks and decodes share a step. Waiting sequences are admitted
FCFS while budget and KV blocks last. When blocks run out, the newest running sequence
is preempted: its blocks are freed and it is recomputed later (prefix caching usually
makes that cheap). A prompt that asks for prompt_logprobs is computed whole (no prefix cache
hits), and at most PROMPT_LOGPROB_ROWS of its positions a step: their logits rows take
memory in proportion (fp32, a vocabulary wide).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atom_runtime.block_manager import BlockManager
from atom_runtime.sequence import Sequence, SequenceStatus

PROMPT_LOGPROB_ROWS = 1024  # prompt positions scored in one step, over all its sequences


class ScheduledChunk:
    """`num_tokens` tokens of `seq` computed in this step, from position `start`.

    A plain slotted class: one is made per scheduled sequence and step.
    """

    __slots__ = ("seq", "start", "num_tokens", "samples", "scored")

    def __init__(self, seq: Sequence, start: int, num_tokens: int):
        self.seq = seq
        self.start = start
        self.num_tokens = num_tokens
        # Whether this chunk reaches the end of the sequence, so its last logits give a new token.
        self.samples = start + num_tokens == len(seq.token_ids)
        # The prompt positions whose logits it returns for prompt_logprobs (each scores the token after it).
        self.scored = seq.positions_to_score(start, num_tokens) if seq.scores_prompt else ()

    def __repr__(self) -> str:
        return f"ScheduledChunk({self.seq!r}, start={self.start}, num_tokens={self.num_tokens})"


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_preempted: int = 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # New prompts are admitted only while this many blocks stay free for running sequences to grow
        # into (vLLM's watermark): admitting into the last blocks only buys a preemption a step later.
        self.watermark_blocks = block_manager.num_blocks // 100

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        rows = PROMPT_LOGPROB_ROWS
        running, chunks, allocate = self.running, out.chunks, self.block_manager.allocate  # hot loop: locals
        # Preemption only removes from the end of `running`, which iteration over it tolerates.
        for seq in running:
            if budget <= 0:
                break
            num_tokens = len(seq.token_ids)
            if num_tokens >= seq.max_num_tokens:  # the step in flight samples its last token
                continue
            num_new = num_tokens - seq.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if seq.scores_prompt:
                if not rows:
                    continue
                num_new = min(num_new, rows)
            while not allocate(seq, num_new):
                victim = running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                chunk = ScheduledChunk(seq, seq.num_computed_tokens, num_new)
                chunks.append(chunk)
                budget -= num_new
                rows -= len(chunk.scored)
                continue
            break  # `seq` itself was preempted: nothing behind it can fit either
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.num_preempted:
            seq = self.waiting[0]
            if seq.scores_prompt and not rows:
                break
            prefix = [] if seq.scores_prompt else self.block_manager.cached_prefix(seq)
            num_new = min(seq.num_tokens - len(prefix) * self.block_manager.block_size, budget)
            if seq.scores_prompt:
                num_new = min(num_new, rows)
            needed = self.block_manager.blocks_to_take(prefix, num_new)
            if self.running and self.block_manager.num_free_blocks - needed < self.watermark_blocks:
                break
            if not self.block_manager.allocate(seq, num_new, prefix):
                break
            self.waiting.popleft()
            if not seq.num_preemptions:  # count the first admission of a prompt, not resumptions
                self.block_manager.prefix_queries += seq.num_tokens
                self.block_manager.prefix_hits += seq.num_computed_tokens
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, num_new)
            out.chunks.append(chunk)
            budget -= num_new
            rows -= len(chunk.scored)
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire `seq` (done, stopped or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
