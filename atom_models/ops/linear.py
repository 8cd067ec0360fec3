"""The dense projection, `x @ weight^T + bias`, as an op of its own.

A traced graph has one token count for every step, but the best kernel depends on it: a decode
step's few rows make the GEMM a weight read, which cuBLAS's tiles spread over too few
multiprocessors. As a custom op, the backend picks the kernel per call (see
`triton_kernels.gemm.linear`); the reference is `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from atom_models.ops.backend import implementation, register_impl


@torch.library.custom_op("atom::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return implementation("linear", x.device)(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_impl("linear", "torch")
def linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)
