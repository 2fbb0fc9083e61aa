"""Norm-read kernels: the torch reference that defines each op, and faster providers."""

from .reference import fused_add_rmsnorm_ref, rmsnorm_ref

__all__ = ["rmsnorm_ref", "fused_add_rmsnorm_ref"]
