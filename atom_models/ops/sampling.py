"""Each row's next token from a step's logits: its argmax, or a draw from softmax(logits / temperature).

A draw is an exponential race: the argmax of logits / T - log(E), with E ~ Exp(1) a vocabulary entry, made from
Philox4x32-10 keyed by the row's seed and counting (vocabulary block, sequence position):
each of a counter's four words serves one quarter of a block of 4 x NOISE_QUARTER entries (`philox_bits`).
So a draw is a function of (seed, position, logits) alone: not of the batch around it, nor of whether a CUDA graph
or the eager sampler made it; it needs no generator state and no noise tensor, and it is one pass over the logits
(softmax, exponential noise, division and argmax took five, and 0.07 ms of a Qwen3-0.6B batch-1 step on an H100).

Captured into the decode graphs after the forward, not traced into it, so it is a plain function that dispatches
to its backend rather than a custom op. torch's own argmax of one 151,936-wide row took 10.7 us on an H100, one
multiprocessor's worth of reduction; split over the row, 4.3 (the argmax kernel this one grew from; see
`triton_kernels.sampling`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl

# Philox4x32-10's constants (Salmon et al., SC'11).
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
MASK32 = 0xFFFFFFFF
SEED_MASK = (1 << 63) - 1  # seeds are int64 tensors: any Python int keys a request through its low 63 bits
# Vocabulary entries a Philox word stream covers: a block of 4 x NOISE_QUARTER entries takes NOISE_QUARTER counters,
# the first quarter their first words, and so on (the kernel's slices are such blocks; see `philox_bits`).
NOISE_QUARTER = 512


def sample_rows(
    logits: Tensor,
    temperature: Tensor,
    seeds: Tensor,
    positions: Tensor,
    out: Tensor | None = None,
    advance: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """Each row's token (int64): where `temperature` is 0 its argmax (the first of equal values, a NaN first of
    all, as `torch.argmax`), elsewhere a draw from softmax(logits / temperature) by the row's int64 seed at the
    row's sequence `position`; -inf logits are never drawn. Written into `out` where given (a decode graph draws
    into its own input ids, where the batch's next decode step reads them).

    `advance` (a decode graph's token positions, slots and sequence lengths, a row each): then every row whose slot
    is not -1 (padding) moves these and its draw position one token on, after the draw, as the batch's next decode
    step would write them; the host then copies only what differs (see `atom_runtime.step_inputs`). A slot that
    crosses into a new block comes out wrong, and that step's upload replaces it."""
    return implementation("sample_rows", logits.device)(logits, temperature, seeds, positions, out, advance)


def advance_decode_inputs(positions: Tensor, advance: tuple[Tensor, Tensor, Tensor]) -> None:
    """`sample_rows`' `advance`, in torch: the rows of non-padding slots one token on, in place."""
    token_positions, slots, seq_lens = advance
    live = slots >= 0
    for field in (positions, token_positions, slots, seq_lens):
        field += live.to(field.dtype)


def carry_tokens(input_ids: Tensor, carry_to: Tensor, carry_from: Tensor, sampled: Tensor) -> None:
    """`input_ids[carry_to[i]] = sampled[carry_from[i]]` wherever `carry_to[i] >= 0`, in place.

    A sequence's newest token may still be on the device when its next step is queued (the host knows it a step
    later): it comes from the previous step's samples. A plain function, like `sample_rows`, which the runtime
    calls between steps; entries of -1 pad the targets to the step's sequence count.
    """
    implementation("carry_tokens", input_ids.device)(input_ids, carry_to, carry_from, sampled)


@register_impl("carry_tokens", "torch")
def carry_tokens_reference(input_ids: Tensor, carry_to: Tensor, carry_from: Tensor, sampled: Tensor) -> None:
    carried = carry_to >= 0
    input_ids[carry_to[carried]] = sampled[carry_from[carried]].to(input_ids.dtype)


def philox_bits(seeds: Tensor, positions: Tensor, n_cols: int) -> Tensor:
    """Each entry's 32 random bits: [rows, n_cols] int64 in [0, 2^32). Entry c of block b = c // (4Q) (Q =
    NOISE_QUARTER) takes word (c % 4Q) // Q of Philox4x32-10 at counter (b * Q + c % Q, position, 0, 0) under key
    `seed` (low word first), the stream `tl.randint4x` gives at offset (position << 32) + counter. Products of two
    32-bit words wrap in int64 with their low 64 bits intact, which is all Philox keeps."""
    quarter = NOISE_QUARTER
    blocks = -(-n_cols // (4 * quarter))
    seeds, positions = seeds.long().unsqueeze(1), positions.long().unsqueeze(1)
    c0 = torch.arange(blocks * quarter, device=seeds.device).expand(seeds.shape[0], -1)
    c1, c2, c3 = (positions & MASK32).expand_as(c0), torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = seeds & MASK32, (seeds >> 32) & MASK32
    for _ in range(10):
        a, b = PHILOX_ROUND_A * c0, PHILOX_ROUND_B * c2
        c0, c1, c2, c3 = ((b >> 32) & MASK32) ^ c1 ^ k0, b & MASK32, ((a >> 32) & MASK32) ^ c3 ^ k1, a & MASK32
        k0, k1 = (k0 + PHILOX_KEY_A) & MASK32, (k1 + PHILOX_KEY_B) & MASK32
    words = torch.stack([c0, c1, c2, c3], dim=1).view(-1, 4, blocks, quarter)  # [rows, word, block, counter]
    return words.transpose(1, 2).reshape(-1, blocks * 4 * quarter)[:, :n_cols]


@register_impl("sample_rows", "torch")
def sample_rows_reference(
    logits: Tensor,
    temperature: Tensor,
    seeds: Tensor,
    positions: Tensor,
    out: Tensor | None = None,
    advance: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """The kernel's arithmetic in torch: a uniform in (0, 1) from the top 23 bits, E = -log(u), and the division
    rounded to nearest (the kernel's `div_rn`), so both draw the same token but for last-bit differences of log.
    23 bits, not 24: (2^24 - 1 + 0.5) * 2^-24 rounds to 1.0 in fp32, whose E = 0 gives a score of +inf (NaN at a
    -inf logit), a token drawn whatever its probability."""
    x = logits.float()
    t = temperature.float().unsqueeze(1)
    uniform = ((philox_bits(seeds, positions, x.shape[1]) >> 9).float() + 0.5) * 2.0**-23
    scores = x / torch.where(t > 0, t, 1.0) - torch.log(-torch.log(uniform))
    tokens = torch.where(t > 0, scores, x).argmax(dim=-1)
    if advance is not None:
        advance_decode_inputs(positions, advance)
    return tokens if out is None else out.copy_(tokens)
