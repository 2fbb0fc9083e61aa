"""The boundary API's other calls under ``torch.compile(fullgraph=True)``: captures (at prepare,
into a collector, ``capture_output``, at the final norm), snapshots, output transforms, extra
contributions, ``complete_output``, ``fold`` / ``written``. Compiled with ``aot_eager`` (eager's
kernels after functionalization), every value kept must be eager's bits."""

from __future__ import annotations

import torch

from layer_boundary import (AuxHiddenStateList, declare_attn, declare_ffn, ForwardBatch, make_stages,
                            OutputTransform, residual_batch as rb, RMSNorm)

H = 16


def _stack():
    g = torch.Generator().manual_seed(0)
    norms = [RMSNorm(H) for _ in range(5)]
    for n in norms:
        n.weight.data = torch.rand(H, generator=g) + 0.5
    w = [torch.randn(H, H, generator=g) / 4 for _ in range(4)]
    double = OutputTransform(lambda y: 2 * y)
    l0 = make_stages((declare_attn(), norms[0]), (declare_ffn(output_transform=double), norms[1]))
    l1 = make_stages((declare_attn(), norms[2]), (declare_ffn(), norms[3]), previous=declare_ffn(), terminal=True)
    rb.bind_final_norm(norms[4])
    return (l0, l1), w, norms[4]


def _forward(layers, w, final, x, extra):
    fb = ForwardBatch(num_tokens=x.shape[0])
    rb.start(fb)
    kept = {}
    h = x
    for i, (attn, ffn) in enumerate(layers):
        cap, col = AuxHiddenStateList(), AuxHiddenStateList()
        y = attn.prepare(h, fb, capture_output=cap.capture, captured_last_layer_outputs=col)
        h = attn.finish(y @ w[2 * i], fb)
        kept[f"snap{i}"] = rb.snapshot(h, fb)
        h, kept[f"copy{i}"] = ffn.capture_output(h, fb)
        y = ffn.prepare(h, fb)
        with ffn.exit(fb) as out:
            z = torch.relu(y @ w[2 * i + 1])
        h = out.finish(z)
        kept[f"cap{i}"], kept[f"col{i}"] = cap[0], col[0]
        if i == 0:
            h = rb.add_to_output(h, fb, extra)
            h = rb.complete_output(h, fb)
            h = rb.fold(h, fb)
            kept["fold"] = h.clone()
            h = rb.written(h.clone(), fb)
    aux = AuxHiddenStateList()
    kept["final"] = rb.norm(h, fb, final, capture_output=aux.capture)
    kept["final_cap"] = aux[0]
    return kept


def test_captures_snapshots_transforms_and_folds_compile_to_eager_bits():
    torch._dynamo.reset()
    layers, w, final = _stack()
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    extra = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        eager = _forward(layers, w, final, x, extra)
        compiled = torch.compile(_forward, fullgraph=True, backend="aot_eager")(layers, w, final, x, extra)
    assert eager.keys() == compiled.keys()
    for k in eager:
        assert torch.equal(eager[k], compiled[k]), k
