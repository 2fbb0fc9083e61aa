"""Quantized stage inputs (``QuantizedRows``) move between ranks like tensors do."""

from __future__ import annotations

import pytest
import torch

from layer_boundary_app.launch import spawn
from layer_boundary._quant import QuantizedRows
from layer_boundary._rows import move_input

import quant_rows_cases


def test_move_input_moves_codes_as_bytes_and_scales_as_they_are():
    seen = []

    def move(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.dtype)
        return torch.cat([t, t])

    q = QuantizedRows(torch.full((2, 4), 1.5).to(torch.float8_e4m3fn), torch.ones(2, 1))
    out = move_input(move, q)
    assert seen == [torch.uint8, torch.float32]
    assert isinstance(out, QuantizedRows) and out.data.dtype == torch.float8_e4m3fn
    assert out.data.shape == (4, 4) and torch.equal(out.data.float(), torch.full((4, 4), 1.5))
    assert torch.equal(move_input(move, torch.ones(1, 2)), torch.ones(2, 2))


@pytest.mark.parametrize("world", [2, 4])
def test_dp_gather_of_quantized_inputs_equals_one_rank(world):
    for rank, res in enumerate(spawn(quant_rows_cases.gather, world, timeout_s=120)):
        assert res == {"data": True, "scale": True, "dtype": "torch.float8_e4m3fn"}, (rank, res)
