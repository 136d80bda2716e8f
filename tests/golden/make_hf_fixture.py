#!/usr/bin/env python3
"""Writes the Hugging Face checkpoint fixtures under tests/fixtures/hf/, from PyTorch (no Hugging Face
code): a small random BertForPreTraining saved the way transformers saves one, three ways, plus the
logits an independent float64 implementation computes from exactly the stored weights.

  tiny/          config.json, model.safetensors (F32, current names, tied decoder omitted as
                 transformers does), vocab.txt (WordPiece, built from tests/fixtures/kjv_paragraphs.txt),
                 tokenizer_config.json
  tiny-bf16/     the same weights in BF16, with old-style names: LayerNorm gamma/beta, the tied
                 cls.predictions.decoder.weight/bias present, the bert.embeddings.position_ids buffer (I64)
  tiny-sharded/  the same weights in F16, in two shards with model.safetensors.index.json
  expected.safetensors  inputs, and MLM/NSP logits for each of the three weight sets (F64)

Run once with Debian's Python (python3-torch):  /usr/bin/python3 tests/golden/make_hf_fixture.py
The safetensors files are written by the few lines below (8-byte header length, JSON header, raw data).
"""
import collections
import json
import os
import re
import struct

import torch

from bert_reference import Bert, make_params

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures")
OUT = os.path.join(FIXTURES, "hf")
torch.manual_seed(4321)

# --- WordPiece vocabulary from the KJV fixture: specials in BERT's layout, characters, frequent words.
text = open(os.path.join(FIXTURES, "kjv_paragraphs.txt"), encoding="utf-8").read().lower()
words = collections.Counter(re.findall(r"[a-z]+", text))
punctuation = sorted(set(c for c in text if not c.isalnum() and not c.isspace()))
vocab = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused1]"]
vocab += punctuation + [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
vocab += ["##" + chr(c) for c in range(ord("a"), ord("z") + 1)] + ["##" + str(d) for d in range(10)]
vocab += ["##eth", "##ed", "##ing", "##est", "##th", "##er", "##ly", "##ness"]
for w, _ in words.most_common():
    if len(vocab) >= 384:
        break
    if w not in vocab and len(w) > 1:
        vocab.append(w)
assert len(set(vocab)) == len(vocab), "duplicate tokens"
V = len(vocab)

config = dict(architectures=["BertForPreTraining"], model_type="bert", vocab_size=V, hidden_size=32,
              num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
              type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12, hidden_dropout_prob=0.1,
              attention_probs_dropout_prob=0.1, initializer_range=0.02, pad_token_id=0,
              position_embedding_type="absolute", torch_dtype="float32", transformers_version="4.40.0")
P = config["max_position_embeddings"]

# --- Weights (float32), under BertForPreTraining's state-dict names.
params = make_params(config, weight_std=0.2, requires_grad=False)

# --- Inputs: B=2, T=12, the second sequence padded.
B, T = 2, 12
input_ids = torch.tensor([[3, 40, 5, 77, 120, 4, 200, 5, 9, 300, 150, 4], [3, 5, 90, 61, 4, 250, 33, 5, 4, 0, 0, 0]])
attention_mask = torch.tensor([[1] * 12, [1] * 9 + [0] * 3])
token_type_ids = torch.tensor([[0] * 6 + [1] * 6, [0] * 5 + [1] * 4 + [0] * 3])
masked_positions = torch.tensor([[2, 7, 9], [1, 7, 0]])

def forward(w):
    """Independent float64 BertForPreTraining forward (eval mode): MLM logits at the masked positions
    (row-major over batch, then position; a 0 ends a row) and NSP logits."""
    model = Bert(config, {k: v.double() for k, v in w.items()})
    x = model.encode(input_ids, attention_mask, token_type_ids)
    return model.mlm_logits(x, masked_positions)[0], model.nsp_logits(x)

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32"}

def save_safetensors(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        t = t.contiguous()
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))

def write_dir(name, tensors, cfg, **kwargs):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_safetensors(os.path.join(d, "model.safetensors"), tensors, **kwargs)
    return d

# tiny/: as transformers saves BertForPreTraining (tied decoder weight and bias left out).
d = write_dir("tiny", params, config, metadata={"format": "pt"})
with open(os.path.join(d, "vocab.txt"), "w", encoding="utf-8") as f:
    f.write("\n".join(vocab) + "\n")
with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"do_lower_case": True, "tokenizer_class": "BertTokenizer"}, f, indent=2)

# tiny-bf16/: BF16, old names, tied decoder present, position_ids buffer.
bf16 = {k: v.to(torch.bfloat16) for k, v in params.items()}
def legacy(name):
    if "LayerNorm" in name:
        return name.replace(".weight", ".gamma").replace(".bias", ".beta")
    return name
old = {legacy(k): v for k, v in bf16.items()}
old["cls.predictions.decoder.weight"] = bf16["bert.embeddings.word_embeddings.weight"]
old["cls.predictions.decoder.bias"] = bf16["cls.predictions.bias"]
old["bert.embeddings.position_ids"] = torch.arange(P, dtype=torch.int64)[None, :]
cfg = dict(config, torch_dtype="bfloat16")
write_dir("tiny-bf16", old, cfg, metadata={"format": "pt"})

# tiny-sharded/: F16 in two shards.
f16 = {k: v.to(torch.float16) for k, v in params.items()}
d = os.path.join(OUT, "tiny-sharded")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(dict(config, torch_dtype="float16"), f, indent=2)
names = list(f16)
shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
          "model-00002-of-00002.safetensors": names[len(names) // 2:]}
weight_map = {}
for file, keys in shards.items():
    save_safetensors(os.path.join(d, file), {k: f16[k] for k in keys}, metadata={"format": "pt"})
    weight_map.update({k: file for k in keys})
with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(t.numel() * 2 for t in f16.values())}, "weight_map": weight_map}, f, indent=2)

# Expected outputs from exactly the stored weights.
expected = {"input_ids": input_ids.int(), "attention_mask": attention_mask.int(), "token_type_ids": token_type_ids.int(),
            "masked_positions": masked_positions.int()}
for tag, w in (("f32", params), ("bf16", bf16), ("f16", f16)):
    mlm, nsp = forward({k: v.float() for k, v in w.items()})
    expected[f"mlm_logits_{tag}"] = mlm
    expected[f"nsp_logits_{tag}"] = nsp
save_safetensors(os.path.join(OUT, "expected.safetensors"), expected,
                 metadata={"made_by": "tests/golden/make_hf_fixture.py, torch " + torch.__version__})
print(f"wrote {os.path.normpath(OUT)}: vocab {V}, {len(params)} tensors, "
      f"{sum(t.numel() for t in params.values())} parameters")
