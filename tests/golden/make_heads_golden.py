#!/usr/bin/env python3
"""Writes tests/fixtures/bert_heads_golden.h5: golden values for the task heads, from an independent plain
PyTorch implementation in float64 (tests/golden/bert_reference.py: torch.nn.functional only, no Hugging Face) of
BertForSequenceClassification (pooler on [CLS], classifier; with one label a regression, problem_type
"regression": the mean squared error of its one output against float scores), BertForTokenClassification (classifier on
every token, cross-entropy over the tokens whose label is not -100) and BertForQuestionAnswering (qa_outputs on
every token, its two columns the start and end logits, the mean of their cross-entropies over the positions),
as transformers defines them.

Run once (needs python3-torch, python3-h5py, python3-numpy from Debian):
    /usr/bin/python3 tests/golden/make_heads_golden.py
One group per head (seq_cls/, token_cls/, qa/, seq_reg/), each with config, params, grads, inputs and expected
outputs (qa: labels (B, 2), the answer's start and end; logits (B, T, 2), as qa_outputs gives them; seq_reg: labels
float32 (B), the scores; logits (B, 1)).
"""
import json
import os

import h5py
import numpy as np
import torch
import torch.nn.functional as F

from bert_reference import QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, Bert, make_params

torch.set_default_dtype(torch.float64)

base = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=12, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.02, pad_token_id=0)
B, T = 3, 8
input_ids = torch.tensor([[2, 11, 4, 17, 3, 25, 9, 3], [2, 4, 30, 4, 3, 12, 0, 0], [2, 7, 8, 3, 0, 0, 0, 0]])
attention_mask = (input_ids != 0).long()
attention_mask[:, 0] = 1
token_type_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0, 0], [0] * 8])


out_path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "bert_heads_golden.h5")
with h5py.File(out_path, "w") as f:
    f.attrs["made_by"] = "tests/golden/make_heads_golden.py, torch " + torch.__version__ + ", float64"
    for group, head, num_labels, seed in (("seq_cls", SEQUENCE_CLASSIFICATION, 3, 4321),
                                          ("token_cls", TOKEN_CLASSIFICATION, 5, 8765),
                                          ("qa", QUESTION_ANSWERING, 2, 2468),
                                          ("seq_reg", SEQUENCE_CLASSIFICATION, 1, 1357)):
        torch.manual_seed(seed)
        w = make_params(base, head, num_labels)
        model = Bert(base, w)
        x = model.encode(input_ids, attention_mask, token_type_ids)
        extra = {}
        if head == SEQUENCE_CLASSIFICATION and num_labels == 1:  # transformers' MSELoss(logits.squeeze(), labels)
            labels = torch.tensor([3.8, 0.5, -1.25])
            logits = model.lin(model.pooled(x), "classifier")  # (B, 1)
            loss = F.mse_loss(logits.squeeze(-1), labels)
            architecture = "BertForSequenceClassification"
            extra = dict(problem_type="regression")
        elif head == SEQUENCE_CLASSIFICATION:
            labels = torch.tensor([2, 0, 1])
            logits = model.lin(model.pooled(x), "classifier")  # (B, labels)
            loss = F.cross_entropy(logits, labels)
            architecture = "BertForSequenceClassification"
        elif head == QUESTION_ANSWERING:
            labels = torch.tensor([[6, 7], [5, 5], [0, 0]])  # an answer, a one-token answer, none ([CLS])
            logits = model.lin(x, "qa_outputs")  # (B, T, 2): every token's start and end logits
            start_logits, end_logits = logits[..., 0], logits[..., 1]
            loss = (F.cross_entropy(start_logits, labels[:, 0]) + F.cross_entropy(end_logits, labels[:, 1])) / 2
            architecture = "BertForQuestionAnswering"
        else:
            labels = torch.tensor([[-100, 1, 4, -100, -100, 0, 2, -100],
                                   [-100, 3, -100, 3, -100, 1, -100, -100],
                                   [-100, 0, 4, -100, -100, -100, -100, -100]])
            logits = model.lin(x, "classifier")  # (B, T, labels): every token
            loss = F.cross_entropy(logits.reshape(B * T, num_labels), labels.reshape(-1), ignore_index=-100)
            architecture = "BertForTokenClassification"
        loss.backward()
        config = dict(base, architectures=[architecture],
                      id2label={str(i): f"L{i}" for i in range(num_labels)},
                      label2id={f"L{i}": i for i in range(num_labels)}, **extra)
        g = f.create_group(group)
        g.attrs["config"] = json.dumps(config)
        for name, t in w.items():
            g[f"params/{name}"] = t.detach().numpy()
            g[f"grads/{name}"] = t.grad.numpy()
        for name, t in dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            labels=labels).items():
            g[f"inputs/{name}"] = t.numpy().astype(np.float32 if t.is_floating_point() else np.int32)
        g["expected/logits"] = logits.detach().numpy()
        g["expected/loss"] = loss.item()
        print(f"{group}: loss {loss.item():.6f}, {len(w)} parameters")
print(f"wrote {os.path.normpath(out_path)}")
