#!/usr/bin/env python3
"""Writes tests/fixtures/bert_qat_golden.h5: golden values for the QAT model test, from the independent
PyTorch model with the quantizers of `bert-train --qat` (QatBert in tests/golden/bert_reference.py) in
float64: every quantizer on (LSQ), the loss, and the gradients of every parameter and every scale.

The scales are max calibration's (amax / 127) times a factor below 1, so that some values saturate; of
1,000 pairs of factors (activations', weights') the one whose quantizer inputs x / s stay farthest from a
rounding or clamping boundary is kept (at least 1e-4 away; 5e-4 as made), where the engine's float32
arithmetic could otherwise round the other way. Run once (python3-torch,
python3-h5py, python3-numpy from Debian):
    /usr/bin/python3 tests/golden/make_qat_golden.py
"""
import math
import os

import torch
import torch.nn.functional as F

from bert_reference import GOLDEN_CONFIG, QatBert, make_params, write_golden

torch.manual_seed(4321)
torch.set_default_dtype(torch.float64)

config = dict(GOLDEN_CONFIG)
params = make_params(config)
# B=2, T=8; the first sequence has one padding position.
input_ids = torch.tensor([[2, 9, 14, 3, 22, 7, 3, 0], [2, 31, 5, 18, 3, 6, 27, 3]])
attention_mask = torch.tensor([[1] * 7 + [0], [1] * 8])
token_type_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1]])
masked_positions = torch.tensor([[1, 4, 0], [2, 3, 6]])
masked_ids = torch.tensor([[11, 19, 0], [8, 33, 26]])
next_sentence_labels = torch.tensor([1, 0])


def forward(model):
    """MLM logits at the masked positions, NSP logits, and their losses."""
    x = model.encode(input_ids, attention_mask, token_type_ids)
    mlm_logits, rows = model.mlm_logits(x, masked_positions)
    targets = [int(masked_ids[b, j]) for b in range(2) for j in range(3) if int(masked_positions[b, j]) != 0]
    nsp_logits = model.nsp_logits(x)
    return (mlm_logits, nsp_logits, F.cross_entropy(mlm_logits, torch.tensor(targets)),
            F.cross_entropy(nsp_logits, next_sentence_labels))


class Margins(QatBert):
    """QatBert noting how close each quantizer's x / s comes to a rounding (k + 1/2) or clamping boundary,
    and how many values saturate."""

    def q(self, name, x, weight=False):
        if self.amax is None:
            v = (x / self.scales[name + "_quantizer.scale"]).detach()
            lo, hi = (-127 if weight else -128), 127
            inside = v[(v > lo - 0.5) & (v < hi + 0.5)]
            near = torch.cat([(inside - inside.floor() - 0.5).abs().flatten(), (v - lo).abs().flatten(),
                              (v - hi).abs().flatten()])
            self.margin = min(self.margin, float(near.min()))
            self.saturated += int(((v < lo) | (v > hi)).sum())
        return super().q(name, x, weight)


def make(config, file_name):
    """Calibrates, searches the scale factors, runs the step and writes the fixture."""
    scales = {}
    model = Margins(config, params, scales)
    model.calibrate(lambda m, _: forward(m), None)
    calibrated = {k: v.detach().clone() for k, v in scales.items()}
    best = None  # (margin, factors, saturated): the candidate whose inputs stay farthest from a boundary
    for attempt in range(1000):
        factors = 0.6 + 0.0002 * attempt, 0.85 + 0.00007 * attempt  # activations', weights'
        for name, s in calibrated.items():
            scales[name] = torch.nn.Parameter(s * (1.0 if ".matmul_a_" in name else
                                                   factors[1] if "weight_quantizer" in name else factors[0]))
        model.margin, model.saturated = math.inf, 0
        with torch.no_grad():
            forward(model)
        if model.saturated > 0 and (best is None or model.margin > best[0]):
            best = model.margin, factors, model.saturated
    margin, (fa, fw), saturated = best
    if margin < 1e-4:
        raise SystemExit(f"no scale factors keep every x / s 1e-4 from a boundary (best {margin:.2e})")
    for name, s in calibrated.items():
        scales[name] = torch.nn.Parameter(s * (1.0 if ".matmul_a_" in name else fw if "weight_quantizer" in name else fa))
    print(f"activation scales x{fa:.3f}, weight scales x{fw:.4f}: margin {margin:.2e}, {saturated} saturated")

    for t in params.values():  # the gradients of this fixture's step alone
        t.grad = None
    mlm_logits, nsp_logits, mlm_loss, nsp_loss = forward(model)
    loss = mlm_loss + nsp_loss
    loss.backward()

    out = os.path.join(os.path.dirname(__file__), "..", "fixtures", file_name)
    write_golden(out, config, "tests/golden/make_qat_golden.py", {**params, **scales},
                 dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                      masked_positions=masked_positions, masked_ids=masked_ids, next_sentence_labels=next_sentence_labels),
                 dict(mlm_logits=mlm_logits, nsp_logits=nsp_logits, mlm_loss=mlm_loss, nsp_loss=nsp_loss, loss=loss,
                      saturated=saturated))  # saturated: values outside [qmin, qmax] in the forward, all quantizers
    print(f"wrote {os.path.normpath(out)}: loss {loss.item():.6f} (mlm {mlm_loss.item():.6f}, nsp {nsp_loss.item():.6f}), "
          f"{len(params)} parameters, {len(scales)} scales")


make(config, "bert_qat_golden.h5")
make(dict(config, weight_quantization="per-tensor"), "bert_qat_per_tensor_golden.h5")
