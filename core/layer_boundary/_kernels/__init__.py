"""Norm-read kernels: the torch reference that defines each op, and faster providers.

The Triton kernels live in ``kernels.triton_ops`` and are imported only when selected (it needs
triton); nothing here imports triton.
"""

from .reference import fused_add_rmsnorm_fp8_ref, fused_add_rmsnorm_ref, rmsnorm_fp8_ref, rmsnorm_ref

__all__ = ["rmsnorm_ref", "fused_add_rmsnorm_ref", "rmsnorm_fp8_ref", "fused_add_rmsnorm_fp8_ref"]
