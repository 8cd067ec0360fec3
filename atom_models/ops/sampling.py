"""Each row's argmax over a step's logits: a greedy batch's tokens, computed inside the decode CUDA graphs.

Captured after the forward, not traced into it, so it is a plain function that dispatches to its backend rather
than a custom op. torch's own argmax of one 151,936-wide row took 10.7 us on an H100, one multiprocessor's worth of
reduction; split over the row, 4.3 (see `triton_kernels.sampling`). Launched on its own after the graph, the Triton
kernel's Python launch cost the host more than it saved the GPU; inside the graph it costs the host nothing.
"""

from __future__ import annotations

from torch import Tensor

from atom_models.ops.backend import implementation, register_impl


def argmax_rows(x: Tensor) -> Tensor:
    """Each row's index of its largest value (int64): the first of equal ones, and a NaN counts as the largest, as
    in `torch.argmax`."""
    return implementation("argmax_rows", x.device)(x)


@register_impl("argmax_rows", "torch")
def argmax_rows_reference(x: Tensor) -> Tensor:
    return x.argmax(dim=-1)
