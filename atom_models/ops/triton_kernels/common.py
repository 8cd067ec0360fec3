"""Helpers shared by the kernels: dtype mapping, launch sizes, programmatic dependent launch, the fp8 row
quantizer, split-arrival counters."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from atom_models.ops.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE

TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    FP8_DTYPE: tl.float8e4nv,
}

# As constexpr globals, so kernels see the same values the reference uses.
FP8_MAX_C = tl.constexpr(FP8_MAX)
MIN_SCALE_C = tl.constexpr(MIN_SCALE)


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """Triton's name for a torch dtype; kernels round intermediates to it like torch ops would."""
    if dtype not in TL_DTYPES:
        raise TypeError(f"the triton backend does not handle dtype {dtype}")
    return TL_DTYPES[dtype]


# Host-side integer helpers. triton.cdiv and triton.next_power_of_2 are constexpr functions, whose calls from Python
# go through Triton's wrapper (~6 us each under cProfile on the H100 host; ~325 a Llama-3-8B mixed step), in launch
# wrappers whose queueing is what bounds such a step (a 512-token budget: 22 ms of host time against 20.8 of kernels).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def row_launch(n_cols: int) -> tuple[int, int]:
    """(block, num_warps) for a kernel that holds one whole row in registers: ~8 elements a thread."""
    block = next_power_of_2(n_cols)
    return block, min(16, max(1, block // 256))


# Programmatic dependent launch (Hopper on): a kernel's programs are resident and waiting while the one before
# it finishes, instead of launching after it, which saves most of the 1-3 us gap between two small decode kernels
# (~290 of them in a Llama-3-8B step). ATOM_PDL=0 turns it off (for A/B timing).
PDL_ENABLED = os.environ.get("ATOM_PDL", "1") != "0"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """What grids are sized against; the interpreter gets a few, so tests cover split and multi-wave launches."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.cache
def pdl_launch(device: torch.device) -> Mapping[str, bool]:
    """Launch arguments of a kernel that starts with `wait_for_previous_kernel(USE_PDL)`: PDL where it is on and
    supported. (Cached: the capability query costs tens of us, and every launch asks.)"""
    on = PDL_ENABLED and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return MappingProxyType({"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False})


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """A PDL kernel waits here until the previous kernel has finished and its writes are visible (before it reads
    anything a kernel of the step writes, or writes anything), then lets the next kernel's programs launch and wait
    (unless LAUNCH_NEXT is False: the kernel calls `launch_next_kernel` itself, later or before the wait). Before
    it, a kernel may read only what no kernel of the step writes: the step's inputs (copied before its first kernel
    starts), weights and tables."""
    if USE_PDL:
        gdc_wait()
        if LAUNCH_NEXT:
            gdc_launch_dependents()


@triton.jit
def launch_next_kernel(USE_PDL: tl.constexpr):
    """Lets the next kernel launch once every program has passed here: late in a kernel of several waves of
    programs, so the next one's programs, waiting, do not take the multiprocessors its later waves need."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def silu(x):
    """x * sigmoid(x) in fp32 through exp2, which lowers to one approximate ex2 (`tl.exp` adds a range fix-up: an
    elementwise SiLU·mul's sm_90 code 152 instructions -> 120). It counts where a one-token GEMV's SiLU·mul prologue
    evaluates it for every column in each of its programs (without the gated_mlp pass): Llama-3-8B's FP8 MLP half
    -0.7 us a layer, Qwen3-0.6B's -0.3 (H100, bench_layer.py).

    log2(e) is written out: a helper that several kernels call must not read a global constexpr, which Triton adds to
    a caller's cache key only if the helper's own key was computed first, so the kernels' keys (and the artifact's
    Triton cache) would depend on the order kernels were first compiled in."""
    return x / (1.0 + tl.exp2(x * -1.4426950408889634))


@triton.jit
def prefetch_to_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (valid addresses); nothing waits for them, and a hint that turns
    out stale costs only bandwidth, so it may use addresses read before a PDL wait."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


_tickets: dict[torch.device, torch.Tensor] = {}


def ticket_counters(device: torch.device, count: int) -> torch.Tensor:
    """Arrival counters for kernels whose last-arriving split merges the others' partials.

    They are zero between launches (the last split to arrive resets its counter), so they are
    allocated and zeroed once per device, not per call: no memset in the step. The one buffer
    serves every launch on the device (split attention, split-K GEMMs), so launches must not
    overlap (one stream).
    """
    tickets = _tickets.get(device)
    if tickets is None or tickets.numel() < count:
        tickets = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
        _tickets[device] = tickets
    return tickets


@triton.jit
def last_to_arrive(ticket_ptr, arrivals):
    """For kernels whose programs each store a partial and the last to arrive merges them all: called once every
    partial is stored, True in the program that arrives last (`arrivals` in all), which resets the counter at
    `ticket_ptr` (see `ticket_counters`) for the next launch and may then read the others' partials past L1."""
    tl.debug_barrier()  # every thread's partial is stored before the ticket (acq_rel) publishes them
    last = tl.atomic_add(ticket_ptr, 1) == arrivals - 1
    if last:
        tl.store(ticket_ptr, 0)
    return last


def inline_scale_operands(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One half (K or V) of a cache with inline scales as the kernels take it: its e4m3 entries, and the same bytes
    as fp32, where a block's scales sit in its last slot (see `atom_models.ops.attention`)."""
    return cache.view(FP8_DTYPE), cache.view(torch.float32)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last_dim] view with unit stride along the row (copies only if it must)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def scale_group(block: int, group_size: int) -> int:
    """`store_fp8_row`'s GROUP for a BLOCK-wide row: the columns one scale covers (BLOCK: the whole row)."""
    if not group_size or group_size >= block:
        return block
    if group_size & (group_size - 1):
        raise ValueError(f"the triton quantizers take power-of-two scale groups, got {group_size}")
    return group_size


@triton.jit
def store_fp8_row(
    y,
    mask,
    n_cols,
    q_ptr,
    scale_ptr,
    row,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr = FP8_MAX_C,
    MIN_SCALE: tl.constexpr = MIN_SCALE_C,
):
    """Quantize the fp32 row `y` ([BLOCK]) to e4m3 with one dynamic scale per GROUP columns, as the reference
    does; the scales go to row `row` of the contiguous [rows, cdiv(n_cols, GROUP)] scale tensor at scale_ptr.

    The e4m3 limits come in as defaults, not read as globals: see `silu` (several kernels call this)."""
    groups = tl.reshape(tl.where(mask, tl.abs(y), 0.0), [BLOCK // GROUP, GROUP])
    scale = tl.maximum(tl.max(groups, axis=1) / FP8_MAX, MIN_SCALE)
    q = tl.reshape(tl.reshape(y, [BLOCK // GROUP, GROUP]) / scale[:, None], [BLOCK])
    tl.store(q_ptr, tl.clamp(q, -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask)
    group = tl.arange(0, BLOCK // GROUP)
    tl.store(scale_ptr + row * tl.cdiv(n_cols, GROUP) + group, scale, mask=group * GROUP < n_cols)
