#!/usr/bin/env python3
"""Writes tests/fixtures/bert_golden.h5: golden values for the model test, from an independent plain
PyTorch implementation of BertForPreTraining in float64 (tests/golden/bert_reference.py: torch.nn.functional
only, no Hugging Face).

Run once (needs python3-torch, python3-h5py, python3-numpy from Debian):
    /usr/bin/python3 tests/golden/make_bert_golden.py   # Debian's Python, where python3-torch lives
The C++ test reads the fixture with HDF5 and needs no Python.
"""
import os

import torch
import torch.nn.functional as F

from bert_reference import GOLDEN_CONFIG, Bert, make_params, write_golden

torch.manual_seed(1234)
torch.set_default_dtype(torch.float64)

config = dict(GOLDEN_CONFIG)
# Parameters with Hugging Face state-dict names; random values large enough to exercise every path.
params = make_params(config)

# A batch: B=2, T=8; the second sequence has two padding positions.
B, T = 2, 8
input_ids = torch.tensor([[2, 11, 4, 17, 3, 25, 9, 3], [2, 4, 30, 4, 3, 12, 0, 0]])
attention_mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
token_type_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0, 0]])
masked_positions = torch.tensor([[2, 5, 0], [1, 3, 5]])
masked_ids = torch.tensor([[8, 25, 0], [14, 21, 12]])
next_sentence_labels = torch.tensor([0, 1])

model = Bert(config, params)
x = model.encode(input_ids, attention_mask, token_type_ids)
mlm_logits, rows = model.mlm_logits(x, masked_positions)
targets = []  # the original tokens at those rows
for b in range(B):
    for j in range(masked_positions.shape[1]):
        if int(masked_positions[b, j]) == 0:
            break
        targets.append(int(masked_ids[b, j]))
mlm_loss = F.cross_entropy(mlm_logits, torch.tensor(targets))
nsp_logits = model.nsp_logits(x)
nsp_loss = F.cross_entropy(nsp_logits, next_sentence_labels)
loss = mlm_loss + nsp_loss
loss.backward()

out = os.path.join(os.path.dirname(__file__), "..", "fixtures", "bert_golden.h5")
write_golden(out, config, "tests/golden/make_bert_golden.py", params,
             dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                  masked_positions=masked_positions, masked_ids=masked_ids, next_sentence_labels=next_sentence_labels),
             dict(mlm_logits=mlm_logits, nsp_logits=nsp_logits, mlm_loss=mlm_loss, nsp_loss=nsp_loss, loss=loss))
print(f"wrote {os.path.normpath(out)}: loss {loss.item():.6f} (mlm {mlm_loss.item():.6f}, nsp {nsp_loss.item():.6f}), "
      f"{len(params)} parameters")
