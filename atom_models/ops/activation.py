"""SiLU(gate) * up over a tensor that holds [gate | up] on its last dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl


@torch.library.custom_op("atom::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    return implementation("silu_and_mul", x.device)(x)


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@register_impl("silu_and_mul", "torch")
def silu_and_mul_reference(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
