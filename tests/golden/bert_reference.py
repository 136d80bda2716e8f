"""An independent BERT in plain PyTorch (torch.nn.functional only, no Hugging Face code), for the golden
fixtures: random parameters under Hugging Face state-dict names, the post-LN encoder, and the heads of
BertForPreTraining, BertForSequenceClassification, BertForTokenClassification and BertForQuestionAnswering
(no dropout unless
asked for), and QatBert: that model with the fake quantizers of `bert-train --qat`. Every fixture script
and the PyTorch side of the speed benchmark (bench/torch_step_bench.py) build on this one module, so there
is one reference to read.
"""
import math

import torch
import torch.nn.functional as F

PRETRAINING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION = "pretraining", "seq_cls", "token_cls"
QUESTION_ANSWERING = "qa"


# The golden fixtures' model (bert_golden.h5, bert_qat_golden.h5): two layers of 16, a 40-token vocabulary.
GOLDEN_CONFIG = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=12, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.02,
                     pad_token_id=0)


def make_params(cfg, head=PRETRAINING, num_labels=0, weight_std=0.3, requires_grad=True, bert_init=False,
                generator=None):
    """Random parameters (draws from `generator`, else torch's global one, in state-dict order): weights
    and embeddings N(0, weight_std), biases N(0, 0.1), LayerNorm gains 1 + N(0, 0.1); with bert_init,
    BERT's initialisation instead (weights N(0, 0.02), biases 0, gains 1). The heads' parameters are those
    transformers has for `head` (token classification and question answering have no pooler)."""
    C, V, I, P = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["max_position_embeddings"]
    params = {}

    def param(name, *shape, kind="weight"):
        if bert_init and kind != "weight":
            t = torch.ones(*shape) if kind == "gamma" else torch.zeros(*shape)
        elif kind == "gamma":
            t = 1.0 + 0.1 * torch.randn(*shape, generator=generator)
        elif kind == "bias":
            t = 0.1 * torch.randn(*shape, generator=generator)
        else:
            t = (0.02 if bert_init else weight_std) * torch.randn(*shape, generator=generator)
        params[name] = t.requires_grad_(True) if requires_grad else t

    def linear(name, n_in, n_out):
        param(name + ".weight", n_out, n_in)
        param(name + ".bias", n_out, kind="bias")

    def norm(name):
        param(name + ".weight", C, kind="gamma")
        param(name + ".bias", C, kind="bias")

    param("bert.embeddings.word_embeddings.weight", V, C)
    param("bert.embeddings.position_embeddings.weight", P, C)
    param("bert.embeddings.token_type_embeddings.weight", 2, C)
    norm("bert.embeddings.LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        p = f"bert.encoder.layer.{i}."
        for n in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            linear(p + n, C, C)
        norm(p + "attention.output.LayerNorm")
        linear(p + "intermediate.dense", C, I)
        linear(p + "output.dense", I, C)
        norm(p + "output.LayerNorm")
    if head in (PRETRAINING, SEQUENCE_CLASSIFICATION):
        linear("bert.pooler.dense", C, C)
    if head == PRETRAINING:
        linear("cls.predictions.transform.dense", C, C)
        norm("cls.predictions.transform.LayerNorm")
        param("cls.predictions.bias", V, kind="bias")
        linear("cls.seq_relationship", C, 2)
    elif head == QUESTION_ANSWERING:
        linear("qa_outputs", C, 2)
    else:
        linear("classifier", C, num_labels)
    return params


class Bert:
    """The forward pass over parameters `w` (a dict of tensors, in the dtype the caller wants). With
    dropout > 0, training-mode dropout where BERT has it (embeddings, attention probabilities, each
    sub-layer's output before its residual)."""

    def __init__(self, cfg, w, dropout=0.0):
        self.cfg, self.w = cfg, w
        self.C = cfg["hidden_size"]
        self.dropout = dropout
        self.drop = (lambda t: F.dropout(t, dropout, True)) if dropout > 0 else (lambda t: t)

    def attend(self, q, k, v, additive):
        """Self-attention of (B, H, T, D) heads: softmax(q k^T / sqrt(D) + additive mask), dropout, times v."""
        probs = self.drop(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + additive, dim=-1))
        return probs @ v

    def lin(self, x, name):
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def norm(self, x, name):
        return F.layer_norm(x, (self.C,), self.w[name + ".weight"], self.w[name + ".bias"],
                            eps=self.cfg["layer_norm_eps"])

    def encode(self, input_ids, attention_mask, token_type_ids):
        """Final hidden states (B, T, C): embeddings, LayerNorm, then post-LN layers with the additive
        -10000 padding mask of the original BERT."""
        T = input_ids.shape[1]
        w = self.w
        x = (F.embedding(input_ids, w["bert.embeddings.word_embeddings.weight"])
             + w["bert.embeddings.position_embeddings.weight"][:T]
             + F.embedding(token_type_ids, w["bert.embeddings.token_type_embeddings.weight"]))
        x = self.drop(self.norm(x, "bert.embeddings.LayerNorm"))
        additive = (1.0 - attention_mask.to(x.dtype))[:, None, None, :] * -10000.0
        for i in range(self.cfg["num_hidden_layers"]):
            x = self.layer(x, additive, f"bert.encoder.layer.{i}.")
        return x

    def heads(self, t):
        """(B, T, C) -> (B, H, T, D)."""
        H = self.cfg["num_attention_heads"]
        return t.view(t.shape[0], t.shape[1], H, self.C // H).transpose(1, 2)

    def layer(self, x, additive, p):
        """One post-LN encoder layer (parameters under prefix p)."""
        q, k, v = (self.heads(self.lin(x, p + "attention.self." + n)) for n in ("query", "key", "value"))
        ctx = self.attend(q, k, v, additive).transpose(1, 2).reshape(x.shape)
        a = self.norm(self.drop(self.lin(ctx, p + "attention.output.dense")) + x, p + "attention.output.LayerNorm")
        ff = self.lin(F.gelu(self.lin(a, p + "intermediate.dense")), p + "output.dense")
        return self.norm(self.drop(ff) + a, p + "output.LayerNorm")

    def pooled(self, x):
        """tanh(pooler(hidden state of [CLS])): (B, C)."""
        return torch.tanh(self.lin(x[:, 0], "bert.pooler.dense"))

    def mlm_logits(self, x, masked_positions):
        """MLM logits at the masked positions, row-major over (batch, position); a 0 ends a row's list."""
        B, T, _ = x.shape
        rows = []
        for b in range(B):
            for j in range(masked_positions.shape[1]):
                if int(masked_positions[b, j]) == 0:
                    break
                rows.append(b * T + int(masked_positions[b, j]))
        return self.mlm_logits_at(x, rows), rows

    def mlm_logits_at(self, x, rows):
        """MLM logits at the given rows of the flattened (B * T, C) hidden states (a list or an index tensor)."""
        h = x.reshape(-1, self.C)[rows]
        h = self.norm(F.gelu(self.lin(h, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
        return F.linear(h, self.w["bert.embeddings.word_embeddings.weight"], self.w["cls.predictions.bias"])

    def nsp_logits(self, x):
        return self.lin(self.pooled(x), "cls.seq_relationship")


def lsq(x, s, qmin, qmax, grad_scale):
    """LSQ fake quantization (Esser et al., 2020), as ops/quantize.cpp computes it: clamp(round(x / s), qmin,
    qmax) * s; x's gradient passes where x / s is inside [qmin, qmax] (straight through), s's is the sum of
    dy * (round(v) - v, or the bound it was clamped to), times grad_scale. Tensor ops only, so that
    torch.compile fuses the quantizer into the ops beside it."""
    s = (s - s * grad_scale).detach() + s * grad_scale
    v = torch.clamp(x / s, qmin, qmax)
    return ((v.round() - v).detach() + v) * s


class QatBert(Bert):
    """The reference model with the fake quantizers of `bert-train --qat` (model/bert.cpp): each quantizable
    linear's input (one for Q, K and V) and weight (per output channel, [-127, 127]; one scale a weight where
    cfg["weight_quantization"] is "per-tensor"), the attention
    products' four inputs (Q, K and V, the probabilities after their dropout) and both inputs of each
    residual add; the pooler and the MLM transform quantized, the decoder and NSP classifier not. Scales
    are parameters (`scales`, trained by the optimizer), set from the largest |x| of one batch by
    calibrate(). The attention is written out: the probabilities' quantizer has no place in SDPA."""

    def __init__(self, cfg, w, scales, dropout=0.0):
        super().__init__(cfg, w, dropout)
        self.scales, self.amax = scales, None
        self.per_tensor_weights = cfg.get("weight_quantization") == "per-tensor"

    def q(self, name, x, weight=False):
        name += "_quantizer.scale"
        if self.amax is not None:  # calibrating: pass-through, note the largest |x| (per row for weights)
            per_row = weight and not self.per_tensor_weights
            a = x.detach().abs().amax(dim=1, keepdim=True) if per_row else x.detach().abs().amax().reshape(1)
            self.amax[name] = torch.maximum(self.amax[name], a) if name in self.amax else a
            return x
        # Elements a scale sees (LSQ's gradient scale): a weight row (the weight), one example.
        n = (x.numel() if self.per_tensor_weights else x.shape[1]) if weight else x[0].numel()
        return lsq(x, self.scales[name], -127 if weight else -128, 127, 1.0 / math.sqrt(n * 127))

    def calibrate(self, loss_fn, batch):
        """Max calibration on `batch`: every scale amax / 127 (the probabilities' bound 1)."""
        self.amax = {}
        with torch.no_grad():
            loss_fn(self, batch)
        for name, a in self.amax.items():
            bound = 1.0 if ".matmul_a_" in name else None
            value = torch.full_like(a, bound) if bound else a.clamp(min=1e-6)
            self.scales[name] = torch.nn.Parameter((value / 127).to(self.w["bert.embeddings.LayerNorm.weight"].dtype))
        self.amax = None

    def lin(self, x, name, quantize_input=True):
        if name == "cls.seq_relationship":
            return super().lin(x, name)
        xq = self.q(name + ".input", x) if quantize_input else x
        return F.linear(xq, self.q(name + ".weight", self.w[name + ".weight"], weight=True), self.w[name + ".bias"])

    def layer(self, x, additive, p):
        a = p + "attention.self."
        xq = self.q(a + "input", x)
        q, k, v = (self.heads(self.q(a + f"matmul_{n[0]}_input", self.lin(xq, a + n, quantize_input=False)))
                   for n in ("query", "key", "value"))
        probs = self.drop(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + additive, dim=-1))
        ctx = (self.q(a + "matmul_a_input", probs) @ v).transpose(1, 2).reshape(x.shape)
        o = p + "attention.output."
        h = self.norm(self.q(o + "add_input", self.drop(self.lin(ctx, o + "dense"))) + self.q(o + "add_residual", x),
                      o + "LayerNorm")
        ff = self.lin(F.gelu(self.lin(h, p + "intermediate.dense")), p + "output.dense")
        o = p + "output."
        return self.norm(self.q(o + "add_input", self.drop(ff)) + self.q(o + "add_residual", h), o + "LayerNorm")


def write_golden(path, config, made_by, params, inputs, expected):
    """Writes a golden fixture (HDF5, read by tests/model/bert_test.cpp): the config as a JSON attribute,
    params/<name> and grads/<name> of every tensor of `params`, inputs/<name> as int32, expected/<name>."""
    import json

    import h5py
    import numpy as np
    with h5py.File(path, "w") as f:
        f.attrs["config"] = json.dumps(config)
        f.attrs["made_by"] = made_by + ", torch " + torch.__version__ + ", float64"
        for name, t in params.items():
            f[f"params/{name}"] = t.detach().numpy()
            f[f"grads/{name}"] = t.grad.numpy()
        for name, t in inputs.items():
            f[f"inputs/{name}"] = t.numpy().astype(np.int32)
        for name, v in expected.items():
            f[f"expected/{name}"] = v.detach().numpy() if torch.is_tensor(v) and v.dim() > 0 else (
                v.item() if torch.is_tensor(v) else v)
