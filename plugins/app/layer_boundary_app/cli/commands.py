"""The application's commands, as the core's ``layer-boundary`` finds them: entry points of
``layer_boundary.commands`` (protocol: :class:`layer_boundary.plugin_api.Command`). This module imports
argparse only; each ``main`` imports its command's module (torch, the models) when it runs.
"""

from __future__ import annotations

import argparse

from .args import DEFAULT_INPUT_IDS, DEFAULT_PATTERN_INPUT_IDS, input_ids, positive, seed

__all__ = ["RUN"]


class RunCommand:
    help = "build a reference decoder on the boundaries and run one forward"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        parser.description = (
            "Build a reference decoder on the boundaries and run one forward on N ranks (spawned here, or "
            "started by torchrun). With no --model it builds an embedded small random Qwen3 (with --moe a "
            "Qwen3-MoE, with --longcat a LongCat-style decoder) on 2 CPU ranks (gloo). The terms it prints "
            "are explained in docs/concepts.md.")
        parser.add_argument("--model", metavar="PATH",
                            help="a Hugging Face checkpoint folder (config.json + *.safetensors); its "
                            "config.json model_type picks the decoder: qwen3 (dense) or qwen3_moe")
        parser.add_argument("--moe", action="store_true",
                            help="build the embedded random Qwen3-MoE instead of the dense Qwen3 (8 "
                            "tensor-parallel experts, top 2; layer 1 dense, the others sparse)")
        parser.add_argument("--defer-moe-finalize", action="store_true",
                            help="let sparse FFNs return finalize handoffs (defer_moe_finalize) that the "
                            "next layer's input or the final norm completes; Qwen3-MoE only")
        parser.add_argument("--fused-finalize", action="store_true",
                            help="fuse each sparse FFN's finalize handoff (top-k combine, shared expert, "
                            "all-reduce, residual add, RMSNorm) into the next attention input and the "
                            "final norm (one Triton kernel on CUDA, the torch reference elsewhere); builds "
                            "zero-centered (Gemma) norms; Qwen3-MoE only")
        parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                            help="run each rank's forward under torch.compile(fullgraph=True) with this "
                            "backend (default inductor; aot_eager compiles in seconds and keeps eager's "
                            "kernels); with --check it is compared with the eager single-rank model")
        parser.add_argument("--tbo", action="store_true",
                            help="two-batch overlap: split each DP group's sequences into two microbatches "
                            "(balanced by tokens) with their own residual streams, interleave their layer "
                            "stages and merge; dense Qwen3 overlaps every layer, Qwen3-MoE its sparse ones")
        parser.add_argument("--longcat", action="store_true",
                            help="build the embedded random LongCat-style decoder: every layer runs a MoE "
                            "branch (8 experts, top 2) beside a dense FFN -> attention -> FFN branch that "
                            "starts from the MoE's prepared input (branch_input) and merges its output "
                            "(branch_output, merge_branch); ordinary token rows only (no input-scattered, "
                            "CP or sequence-parallel variant), --pp and --defer-moe-finalize allowed")
        parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                            help="compute dtype of the whole model (default float32, whatever dtype a --model "
                              "checkpoint was saved in: its weights are cast)")
        parser.add_argument(
            "--input-ids", type=input_ids, default=None, metavar="IDS",
            help=f"comma-separated token ids; several sequences separated by ';' (default: {DEFAULT_INPUT_IDS}; "
            f"with --pattern {DEFAULT_PATTERN_INPUT_IDS})",
        )
        parser.add_argument("--save-logits", metavar="FILE", help="torch.save the float32 logits [tokens, vocab]")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--tp", type=positive, default=None, metavar="N",
                            help="ranks (the world size of a stage group); default 2 for the embedded model "
                            "on CPU, else 1")
        parser.add_argument("--dp", type=positive, default=1, metavar="D",
                            help="attention data parallel: D groups of N/D attention-TP ranks (D divides N)")
        parser.add_argument("--pp", type=positive, default=1, metavar="P",
                            help="pipeline stages (layers split evenly, the remainder on the last); the "
                            "world is N x P ranks, stage s on ranks [s*N, (s+1)*N)")
        parser.add_argument("--cp", type=positive, default=1, metavar="C",
                            help="context-parallel prefill: each sequence's tokens spread (zig-zag) over C "
                            "ranks of attention TP, heads over the other N/D/C (C divides N/D; needs --dp 1)")
        parser.add_argument("--reduction", choices=("auto", "ar", "rs", "rsv", "rs+rsv"), default="auto",
                            help="FFN output return permissions under attention DP (default: auto)")
        parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                            help="torch.distributed backend (default: gloo on CPU, nccl on CUDA)")
        parser.add_argument("--check", action="store_true",
                            help="compare every rank's logits with the single-rank model built with the same "
                              "kernels (it checks the layout, not a kernel against the torch reference: "
                              "that is the conformance kit, pytest -p layer_boundary.testing); exit 1 on a "
                              "mismatch")
        parser.add_argument("--seed", type=seed, default=0, help="seed of the embedded random model")
        parser.add_argument(
            "--pattern", metavar="LAYERS", default=None,
            help="build the embedded random heterogeneous decoder instead of Qwen3, one layer per "
            "character: M (gated short-convolution mixer), * (attention), - (dense FFN); e.g. 'M-M*-' "
            "(one that starts with '-' is given with '=': --pattern=-M*-)",
        )
        parser.add_argument(
            "--residual", default="plain", metavar="SCHEME",
            help="residual scheme: plain add (built in), mhc (manifold-constrained hyper-connections, "
            "from the layer-boundary-mhc plugin) or any scheme an active plugin registers (an unknown "
            "name is refused with those available) (default: plain)",
        )

    def main(self, args: argparse.Namespace) -> int:
        from .run import run_command

        args.default_ids = args.input_ids is None
        if args.input_ids is None:
            args.input_ids = input_ids(DEFAULT_PATTERN_INPUT_IDS if args.pattern else DEFAULT_INPUT_IDS)
        return run_command(args)


RUN = RunCommand()
