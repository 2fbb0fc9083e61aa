"""Adapters for integrations that need more than a sequential prepare call (see the spec's
"Special adapters"): ``lora`` publishes the rows a stage's compute input lives on; ``tbo`` splits a
batch into two microbatches with their own streams, interleaves their stages and merges them;
``branch`` enters a stage from another stage's prepared input and merges two branches' outputs."""

from .branch import BranchOutput, branch_output, merge_branch
from .lora import InputRows, RowKind, input_rows
from .tbo import TboPlan, TboRows, TboSplit, merge_streams, model_forward_stages, plan_overlap, split_stream

__all__ = ["BranchOutput", "branch_output", "merge_branch", "InputRows", "RowKind", "input_rows",
           "TboPlan", "TboRows", "TboSplit", "merge_streams", "model_forward_stages", "plan_overlap",
           "split_stream"]
