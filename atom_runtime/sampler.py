"""Batched sampling on the logits' device: logit masks, penalties, temperature, min-p, top-k/top-p, seeds, logprobs.

Tokens are drawn by `atom_models.ops.sampling.sample_rows` (an exponential race over counter-based noise keyed by
each sequence's seed and position): a seeded request's output does not depend on what else is in the batch, nor
on whether a decode graph drew its token or this sampler did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from atom_models.ops.sampling import sample_rows
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.sequence import Sequence
from atom_runtime.structured_outputs import apply_masks


@dataclass
class SampledTokens:
    token_ids: list[int]
    # Per row, when any row asked for logprobs: (token ids, logprobs) of the sampled token
    # followed by the top-k, and the sampled token's rank (1 = most likely).
    logprob_token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None
    prompt: SampledTokens | None = None  # the prompt positions scored for prompt_logprobs, in their rows' order

    @classmethod
    def empty(cls) -> SampledTokens:
        """No rows, with logprobs: what rows are gathered into."""
        return cls([], [], [], [])


@dataclass
class DeviceSample:
    """A step's samples still on the device; `to_host` waits for them.

    `token_ids` may be a view of a decode graph's output (its drawn tokens, in its input ids), which the next step's
    upload or replay overwrites: what reads it on the device (the copy `start_copy` queues, the next step's carried
    tokens) is queued before those, in stream order."""

    token_ids: Tensor
    logprob_token_ids: Tensor | None = None
    logprobs: Tensor | None = None
    ranks: Tensor | None = None
    prompt: DeviceSample | None = None  # the prompt positions scored (their tokens, with logprobs), if any
    host: dict[str, Tensor] | None = None
    ready: torch.cuda.Event | None = None

    def start_copy(self, token_buffer: Tensor | None = None, ready: torch.cuda.Event | None = None) -> None:
        """Begin the device-to-host copy now, so the host can wait for it later without a sync point here.

        `token_buffer` (pinned, at least as long as the batch) and `ready` let the caller reuse the
        host buffer and event of an earlier step, so the step loop allocates neither.
        """
        if self.prompt is not None:
            self.prompt.start_copy()
        tensors = {k: v for k, v in vars(self).items() if isinstance(v, Tensor)}
        if self.token_ids.device.type != "cuda":
            self.host = tensors
            return
        self.host = {
            k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in tensors.items() if k != "token_ids"
        }
        if token_buffer is None:
            token_buffer = torch.empty(self.token_ids.shape, dtype=self.token_ids.dtype, pin_memory=True)
        self.host["token_ids"] = token_buffer[: self.token_ids.shape[0]]
        for k, v in tensors.items():
            self.host[k].copy_(v, non_blocking=True)
        self.ready = ready or torch.cuda.Event()
        self.ready.record()

    def to_host(self) -> SampledTokens:
        if self.host is None:
            self.start_copy()
        if self.ready is not None:
            self.ready.synchronize()
        h = self.host
        prompt = self.prompt.to_host() if self.prompt is not None else None
        if "logprobs" not in h:
            return SampledTokens(h["token_ids"].tolist(), prompt=prompt)
        lists = [h[k].tolist() for k in ("token_ids", "logprob_token_ids", "logprobs", "ranks")]
        return SampledTokens(*lists, prompt=prompt)


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small per-step tensor made without waiting for the device.

    `torch.tensor(values, device="cuda")` copies from pageable memory, which waits for every step
    queued on the stream: it would undo the overlap of host and GPU. A pinned copy does not wait.
    """
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


class Draws(NamedTuple):
    """Each logits row's draw: temperature (0: greedy), seed and the position of the token it samples (device
    tensors, `atom_models.ops.sampling.sample_rows`' arguments after the logits, in order)."""

    temperature: Tensor
    seeds: Tensor
    positions: Tensor


class Sampler:
    def __call__(self, logits: Tensor, seqs: list[Sequence], draws: Draws, drawn: Tensor | None = None) -> DeviceSample:
        """Sample one token per row; nothing here waits for the device. `drawn`: each row's `sample_rows` over
        `logits` by `draws`, where the step made it already (a decode graph does): the batch's tokens, unless
        penalties or min_tokens change the logits or a row filters them (top-k, top-p, min-p). That draw moved the
        positions in `draws` one token on (`sample_rows`' `advance`): rows drawn again here take them one back."""
        params = [s.params for s in seqs]
        raw_logits = logits
        if any(p.shapes_logits for p in params):
            logits = self._shape(logits.clone(), seqs)
        if any(p.structured_outputs is not None for p in params):
            logits = logits.clone() if logits is raw_logits else logits
            apply_masks(logits, [s.matcher for s in seqs])
        if any(p.min_tokens and s.num_output_tokens < p.min_tokens for s, p in zip(seqs, params, strict=True)):
            logits = self._block_stop_tokens(logits.clone() if logits is raw_logits else logits, seqs)
        if any(p.needs_penalties for p in params):  # last, as vLLM: a repetition penalty scales a logit_bias too
            logits = self._apply_penalties(logits, seqs)  # (a new tensor)
        filtered = any(p.filters for p in params)
        if drawn is not None and (filtered or logits is not raw_logits):  # drawn again, where the graph's draw was
            draws = draws._replace(positions=draws.positions - 1)
        if filtered:
            sampled = self._filtered_draw(logits, params, draws)
        elif drawn is not None and logits is raw_logits:
            sampled = drawn
        elif all(p.greedy for p in params):  # `sample_rows` at temperature 0, for less host time than a Triton launch
            sampled = logits.argmax(dim=-1)
        else:
            sampled = sample_rows(logits, *draws)
        num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if num_logprobs is None:
            return DeviceSample(sampled)
        return with_logprobs(raw_logits, sampled, num_logprobs)

    def _apply_penalties(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        batch, vocab = logits.shape
        device = logits.device
        counts = torch.zeros(batch, vocab, device=device)
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        for row, seq in enumerate(seqs):
            if not seq.params.needs_penalties:
                continue
            out = on_device(seq.output_token_ids, torch.long, device)
            counts[row].index_add_(0, out, torch.ones(len(out), device=device))
            seen[row, on_device(seq.token_ids, torch.long, device)] = True
        rep = on_device([s.params.repetition_penalty for s in seqs], torch.float32, device).unsqueeze(1)
        freq = on_device([s.params.frequency_penalty for s in seqs], torch.float32, device).unsqueeze(1)
        pres = on_device([s.params.presence_penalty for s in seqs], torch.float32, device).unsqueeze(1)
        # Repetition penalty (prompt and output, as HF/vLLM): shrink positive logits, grow negative ones.
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * counts - pres * (counts > 0).float()

    @staticmethod
    def _shape(logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """logit_bias, allowed_token_ids and bad words, in place: the bias added, tokens not allowed at -inf, and so
        the last token of a bad word whose other tokens the output ends with."""
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.allowed_token_ids is not None:
                allowed = on_device(p.allowed_token_ids, torch.long, logits.device)
                kept = logits[row, allowed]
                logits[row] = float("-inf")
                logits[row, allowed] = kept
            if p.logit_bias:
                tokens = on_device(list(p.logit_bias), torch.long, logits.device)
                logits[row, tokens] += on_device(list(p.logit_bias.values()), torch.float32, logits.device)
            if p.bad_words_token_ids:
                output = seq.output_token_ids
                banned = [w[-1] for w in p.bad_words_token_ids if len(w) == 1 or output[-(len(w) - 1) :] == w[:-1]]
                if banned:
                    logits[row, on_device(banned, torch.long, logits.device)] = float("-inf")
        return logits

    def _block_stop_tokens(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """min_tokens: stop tokens at -inf, except in a row whose grammar allows nothing else (it ends there)."""
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens and seq.stops_on:
                # (stop_token_ids outside the vocabulary are never drawn: nothing to block, nor to index)
                in_vocab = sorted(t for t in seq.stops_on if 0 <= t < logits.shape[1])
                stops = on_device(in_vocab, torch.long, logits.device)
                if seq.matcher is None:
                    logits[row, stops] = float("-inf")
                else:  # chosen on the device: no sync
                    blocked = logits[row].index_fill(0, stops, float("-inf"))
                    logits[row] = torch.where(torch.isneginf(blocked).all(), logits[row], blocked)
        return logits

    def _filtered_draw(self, logits: Tensor, params: list[SamplingParams], draws: Draws) -> Tensor:
        """Drawn rows draw from what top-k, top-p and min-p leave of logits / T (as a draw at temperature 1); greedy
        rows are left unfiltered, so their argmax is the logits' own (top-p's unstable sort could drop the first of
        equal largest ones)."""
        device = logits.device
        top_k = [-1 if p.greedy else p.top_k for p in params]
        top_p = [1.0 if p.greedy else p.top_p for p in params]
        min_p = [0.0 if p.greedy else p.min_p for p in params]
        scaled = logits / torch.where(draws.temperature > 0, draws.temperature, 1.0).unsqueeze(1)
        # min-p first, as vLLM: top-p then takes its share of what min-p leaves.
        if any(p > 0 for p in min_p):  # p < min_p * max(p), as logits: below max(scaled) + log(min_p)
            floor = scaled.amax(dim=-1, keepdim=True) + on_device(min_p, torch.float32, device).log().unsqueeze(1)
            scaled = scaled.masked_fill(scaled < floor, float("-inf"))
        if any(k > 0 for k in top_k):
            scaled = self._top_k(scaled, top_k)
        if any(p < 1.0 for p in top_p):
            scaled = self._top_p(scaled, on_device(top_p, torch.float32, device))
        unit = on_device([0.0 if p.greedy else 1.0 for p in params], torch.float32, device)
        return sample_rows(scaled, unit, draws.seeds, draws.positions)

    @staticmethod
    def _top_k(logits: Tensor, top_k: list[int]) -> Tensor:
        vocab = logits.shape[1]
        ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
        values = logits.topk(max(ks), dim=-1).values  # the largest k from the host list: no .item() sync
        ks = on_device(ks, torch.long, logits.device)
        threshold = values.gather(1, (ks - 1).unsqueeze(1))
        return logits.masked_fill(logits < threshold, float("-inf"))

    @staticmethod
    def _top_p(logits: Tensor, top_p: Tensor) -> Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        # A row at top_p 1 drops nothing: its rounded cumulative sum can reach 1 before its last tokens.
        drop = ((cumulative - sorted_logits.softmax(dim=-1)) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False
        return logits.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def with_logprobs(logits: Tensor, tokens: Tensor, k: int) -> DeviceSample:
    """Each row's `tokens` with its logprob under `logits` and rank, followed by the row's top `k`: what logprobs
    (the sampled tokens) and prompt_logprobs (the prompt's next tokens) return."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], tokens.unsqueeze(1)[:, :0])
    ids = torch.cat([tokens.unsqueeze(1), top_ids], dim=1)
    values = torch.cat([chosen, top_values], dim=1)
    return DeviceSample(tokens, ids, values, ranks)
