#!/usr/bin/env python3
"""Writes tests/fixtures/bert_golden.h5: golden values for the model test, from an independent plain
PyTorch implementation of BertForPreTraining in float64 (torch.nn.functional only, no Hugging Face).

Run once (needs python3-torch, python3-h5py, python3-numpy from Debian):
    /usr/bin/python3 tests/golden/make_bert_golden.py   # Debian's Python, where python3-torch lives
The C++ test reads the fixture with HDF5 and needs no Python.
"""
import json
import math
import os

import h5py
import numpy as np
import torch
import torch.nn.functional as F

torch.manual_seed(1234)
torch.set_default_dtype(torch.float64)

config = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
              max_position_embeddings=12, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.02, pad_token_id=0)
V, C, L, H, I, P = (config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "intermediate_size", "max_position_embeddings"))
D = C // H

# Parameters with Hugging Face state-dict names; random values large enough to exercise every path.
params = {}
def param(name, *shape, kind="weight"):
    if kind == "gamma":
        t = 1.0 + 0.1 * torch.randn(*shape)
    elif kind == "bias":
        t = 0.1 * torch.randn(*shape)
    else:
        t = 0.3 * torch.randn(*shape)
    params[name] = t.requires_grad_(True)
    return params[name]

def linear_params(name, n_in, n_out):
    param(name + ".weight", n_out, n_in)
    param(name + ".bias", n_out, kind="bias")

def norm_params(name):
    param(name + ".weight", C, kind="gamma")
    param(name + ".bias", C, kind="bias")

param("bert.embeddings.word_embeddings.weight", V, C)
param("bert.embeddings.position_embeddings.weight", P, C)
param("bert.embeddings.token_type_embeddings.weight", 2, C)
norm_params("bert.embeddings.LayerNorm")
for i in range(L):
    p = f"bert.encoder.layer.{i}."
    for n in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
        linear_params(p + n, C, C)
    norm_params(p + "attention.output.LayerNorm")
    linear_params(p + "intermediate.dense", C, I)
    linear_params(p + "output.dense", I, C)
    norm_params(p + "output.LayerNorm")
linear_params("bert.pooler.dense", C, C)
linear_params("cls.predictions.transform.dense", C, C)
norm_params("cls.predictions.transform.LayerNorm")
param("cls.predictions.bias", V, kind="bias")
linear_params("cls.seq_relationship", C, 2)

# A batch: B=2, T=8; the second sequence has two padding positions.
B, T = 2, 8
input_ids = torch.tensor([[2, 11, 4, 17, 3, 25, 9, 3], [2, 4, 30, 4, 3, 12, 0, 0]])
attention_mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
token_type_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0, 0]])
masked_positions = torch.tensor([[2, 5, 0], [1, 3, 5]])
masked_ids = torch.tensor([[8, 25, 0], [14, 21, 12]])
next_sentence_labels = torch.tensor([0, 1])

def w(name):
    return params[name]

def lin(x, name):
    return F.linear(x, w(name + ".weight"), w(name + ".bias"))

def norm(x, name):
    return F.layer_norm(x, (C,), w(name + ".weight"), w(name + ".bias"), eps=config["layer_norm_eps"])

x = (F.embedding(input_ids, w("bert.embeddings.word_embeddings.weight"))
     + w("bert.embeddings.position_embeddings.weight")[:T]
     + F.embedding(token_type_ids, w("bert.embeddings.token_type_embeddings.weight")))
x = norm(x, "bert.embeddings.LayerNorm")
additive = (1.0 - attention_mask.double())[:, None, None, :] * -10000.0
for i in range(L):
    p = f"bert.encoder.layer.{i}."
    split = lambda t: t.view(B, T, H, D).transpose(1, 2)
    q, k, v = (split(lin(x, p + "attention.self." + n)) for n in ("query", "key", "value"))
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + additive, dim=-1)
    ctx = (probs @ v).transpose(1, 2).reshape(B, T, C)
    a = norm(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
    ff = lin(F.gelu(lin(a, p + "intermediate.dense")), p + "output.dense")
    x = norm(ff + a, p + "output.LayerNorm")

rows, targets = [], []
for b in range(B):
    for j in range(masked_positions.shape[1]):
        pos = int(masked_positions[b, j])
        if pos == 0:
            break
        rows.append(b * T + pos)
        targets.append(int(masked_ids[b, j]))
hidden = x.reshape(B * T, C)
h = norm(F.gelu(lin(hidden[rows], "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
mlm_logits = F.linear(h, w("bert.embeddings.word_embeddings.weight"), w("cls.predictions.bias"))
mlm_loss = F.cross_entropy(mlm_logits, torch.tensor(targets))
pooled = torch.tanh(lin(hidden[[b * T for b in range(B)]], "bert.pooler.dense"))
nsp_logits = lin(pooled, "cls.seq_relationship")
nsp_loss = F.cross_entropy(nsp_logits, next_sentence_labels)
loss = mlm_loss + nsp_loss
loss.backward()

out = os.path.join(os.path.dirname(__file__), "..", "fixtures", "bert_golden.h5")
with h5py.File(out, "w") as f:
    f.attrs["config"] = json.dumps(config)
    f.attrs["made_by"] = "tests/golden/make_bert_golden.py, torch " + torch.__version__ + ", float64"
    for name, t in params.items():
        f[f"params/{name}"] = t.detach().numpy()
        f[f"grads/{name}"] = t.grad.numpy()
    for name, t in dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                        masked_positions=masked_positions, masked_ids=masked_ids,
                        next_sentence_labels=next_sentence_labels).items():
        f[f"inputs/{name}"] = t.numpy().astype(np.int32)
    f["expected/mlm_logits"] = mlm_logits.detach().numpy()
    f["expected/nsp_logits"] = nsp_logits.detach().numpy()
    f["expected/mlm_loss"] = mlm_loss.item()
    f["expected/nsp_loss"] = nsp_loss.item()
    f["expected/loss"] = loss.item()
print(f"wrote {os.path.normpath(out)}: loss {loss.item():.6f} (mlm {mlm_loss.item():.6f}, nsp {nsp_loss.item():.6f}), "
      f"{len(params)} parameters")
