#!/usr/bin/env python3
"""The PyTorch side of the training-speed benchmark: the same BertForPreTraining as ours
(post-LN, erf GELU, tied MLM decoder evaluated at the masked positions, NSP head), from the project's
one PyTorch reference (tests/golden/bert_reference.py: torch.nn.functional only, no Hugging Face), with
BERT's initialisation and dropout 0.1, the same shapes and synthetic batches, one full training
step (forward, backward, clip_grad_norm, AdamW) timed as the median of --steps after --warmup (and
--warmup-seconds; on a GPU the mean of --steps steps run back to back, as our train-step-bench times them), and
evaluation throughput (forward, no grad; timed the same way). Prints one JSON object per configuration. --dtype fp32
(strict), bf16 (autocast to bfloat16, FP32 master weights; CPU or GPU) or, on a GPU (--device cuda), tf32
(TF32 matmuls); --compile for torch.compile. PyTorch at its best on a GPU: --attention sdpa
(torch.nn.functional.scaled_dot_product_attention, fused attention; no mask argument, nothing is padded, as
Hugging Face passes none then), --adamw fused and --compile; --seq for the sequence length. --qat: the step
of `bert-train --qat` (QatBert: the same quantizers, LSQ, written in tensor ops for torch.compile to fuse).

Run with Debian's Python (python3-torch), e.g.
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=2 /usr/bin/python3 bench/torch_step_bench.py --threads 1
bench/speed.sh runs it beside train-step-bench and prints the ratios.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"))
from bert_reference import Bert, QatBert, make_params  # noqa: E402  (the one PyTorch BERT of the project)

PRESETS = {"tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "medium": (8, 512), "base": (12, 768),
           "large": (24, 1024)}


class SdpaBert(Bert):
    """The reference model with fused attention (PyTorch 2's scaled_dot_product_attention: FlashAttention or
    memory-efficient kernels on a GPU). The synthetic batches pad nothing, so no mask is passed."""

    def attend(self, q, k, v, additive):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.dropout > 0 else 0.0)


def config(preset, vocab, seq=512):
    """Our preset's shape (model/config.cpp) as the reference model's config."""
    layers, hidden = PRESETS[preset]
    return {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": max(2, hidden // 64),
            "intermediate_size": 4 * hidden, "vocab_size": vocab, "max_position_embeddings": seq,
            "layer_norm_eps": 1e-12}


def pretraining_loss(model, batch):
    """MLM cross-entropy at the masked positions (every batch row has all of them) + NSP cross-entropy."""
    ids, mask, types, positions, masked_ids, nsp_labels = batch
    b, t = ids.shape
    x = model.encode(ids, mask, types)
    rows = (torch.arange(b, device=ids.device)[:, None] * t + positions).reshape(-1)
    mlm = model.mlm_logits_at(x, rows)
    return F.cross_entropy(mlm, masked_ids.reshape(-1)) + F.cross_entropy(model.nsp_logits(x), nsp_labels)


def synthetic_batch(b, t, p, vocab, seed=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (b, t), generator=g)
    ids[:, 0] = 2
    mask = torch.ones(b, t, dtype=torch.long)
    types = torch.zeros(b, t, dtype=torch.long)
    types[:, t // 2:] = 1
    positions = torch.tensor([1 + k * (t - 2) // p for k in range(p)]).repeat(b, 1)
    masked_ids = torch.randint(5, vocab, (b, p), generator=g)
    nsp = torch.randint(0, 2, (b,), generator=g)
    return ids, mask, types, positions, masked_ids, nsp


def profile_steps(a, name, b, step, what):
    """Runs `step` --steps times under torch.profiler and prints the ops' self CPU time per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / 1e3 / a.steps
    print(f"\nops of the {name} b{b} {what} (torch {torch.__version__}, {a.threads} threads), "
          f"{a.steps} steps profiled: self ms per step, total {total:.2f}", file=sys.stderr)
    for e in rows[:30]:
        print(f"{e.key:<44} {e.self_cpu_time_total / 1e3 / a.steps:10.2f} {e.count / a.steps:8.1f}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,mini")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--warmup-seconds", type=float, default=0.0,
                    help="and untimed steps until this many seconds have passed (a GPU reaches its clocks after "
                         "a moment of load)")
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--flush-denormals", action="store_true",
                    help="torch.set_flush_denormal(True): denormals flushed to zero, as our programs do by default")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    ap.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune"],
                    help="torch.compile's mode: reduce-overhead replays CUDA graphs (no per-kernel launch cost "
                         "on the host), max-autotune also tunes the GEMMs")
    ap.add_argument("--attention", default="explicit", choices=["explicit", "sdpa"],
                    help="explicit: softmax(q k^T) v as written; sdpa: scaled_dot_product_attention (fused)")
    ap.add_argument("--adamw", default="default", choices=["default", "fused"],
                    help="AdamW as torch picks it (foreach), or its fused CUDA kernel")
    ap.add_argument("--seq", type=int, default=128, help="sequence length (20 masked positions; 80 from 512 on)")
    ap.add_argument("--qat", action="store_true",
                    help="the QAT step (QatBert: the quantizers of bert-train --qat, LSQ, scales calibrated by max on "
                         "the batch; the attention written out)")
    ap.add_argument("--profile", action="store_true",
                    help="after each measurement, --steps more training steps and evaluations under torch.profiler: "
                         "the ops' self time per step, to stderr (the baseline of train-step-bench --profile)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.flush_denormals and not torch.set_flush_denormal(True):
        sys.exit("torch.set_flush_denormal: not supported on this CPU")
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = a.dtype == "tf32"
        torch.backends.cudnn.allow_tf32 = a.dtype == "tf32"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if a.qat and a.attention == "sdpa":
        sys.exit("--qat: the probabilities' quantizer needs the attention written out; leave --attention explicit")
    if a.dtype == "tf32" and not cuda:
        sys.exit("--dtype tf32 is a GPU format: on the CPU use fp32 or bf16")
    # bf16: autocast to bfloat16 (on the CPU its matmuls run on oneDNN's BF16 kernels: AVX512_BF16 or AMX
    # where the CPU has them), FP32 master weights, on either device.
    autocast = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if a.dtype == "bf16" else (
        lambda: torch.autocast(dev.type, enabled=False))
    fwd = torch.compile(pretraining_loss, mode=a.compile_mode) if a.compile else pretraining_loss
    t = a.seq
    p = 80 if t >= 512 else min(20, t - 2)
    model_class = SdpaBert if a.attention == "sdpa" else Bert
    for name in a.presets.split(","):
        for b in map(int, a.batches.split(",")):
            cfg = config(name, a.vocab, max(512, t))
            w = make_params(cfg, bert_init=True, requires_grad=False, generator=torch.Generator().manual_seed(1))
            w = {k: torch.nn.Parameter(v.to(dev)) for k, v in w.items()}
            batch = tuple(x.to(dev) for x in synthetic_batch(b, t, p, a.vocab))
            scales = {}  # QAT: the quantizers' scales, set by calibrate()
            if a.qat:
                training, evaluation = QatBert(cfg, w, scales, dropout=0.1), QatBert(cfg, w, scales)
                with autocast():
                    evaluation.calibrate(pretraining_loss, batch)
            else:
                training, evaluation = model_class(cfg, w, dropout=0.1), model_class(cfg, w)
            params = list(w.values()) + list(scales.values())
            groups = [{"params": list(w.values())}] + (
                [{"params": list(scales.values()), "weight_decay": 0.0}] if scales else [])  # scales: no decay
            opt = torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.01, **({"fused": True} if a.adamw == "fused" else {}))
            def train_step(wait=True):
                opt.zero_grad(set_to_none=True)
                with autocast():
                    loss = fwd(training, batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                if wait:
                    sync()

            def eval_step(wait=True):
                with autocast():
                    fwd(evaluation, batch)
                if wait:
                    sync()

            def warm_up(one_step):  # at least --warmup steps, for at least --warmup-seconds
                begin, s = time.perf_counter(), 0
                while s < a.warmup or time.perf_counter() - begin < a.warmup_seconds:
                    one_step()
                    s += 1

            times = []
            warm_up(train_step)
            if cuda:  # steps back to back, as a training loop queues them: the mean from first to last
                start = time.perf_counter()
                for s in range(a.steps):
                    train_step(wait=False)
                sync()
                times.append((time.perf_counter() - start) / a.steps)
            else:
                for s in range(a.steps):
                    start = time.perf_counter()
                    train_step()
                    times.append(time.perf_counter() - start)
            eval_times = []
            with torch.no_grad():
                warm_up(eval_step)
                if cuda:  # batches back to back, as an evaluation loop queues them (ours: eval::BatchEvaluator)
                    start = time.perf_counter()
                    for s in range(a.steps):
                        eval_step(wait=False)
                    sync()
                    eval_times.append((time.perf_counter() - start) / a.steps)
                else:
                    for s in range(a.steps):
                        start = time.perf_counter()
                        eval_step()
                        eval_times.append(time.perf_counter() - start)
            if a.profile:
                profile_steps(a, name, b, lambda: train_step(), "training step")
                with torch.no_grad():
                    profile_steps(a, name, b, lambda: eval_step(), "evaluation")
            step = statistics.median(times)
            mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            # Device memory in use (context and allocator cache included): what our train-step-bench reports.
            used = (lambda free, total: (total - free) / 2**30)(*torch.cuda.mem_get_info()) if cuda else 0.0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            print(json.dumps({"preset": name, "batch": b, "seq": t, "device": a.device, "dtype": a.dtype,
                              "attention": a.attention, "qat": a.qat, "adamw": a.adamw, "compile": a.compile,
                              "compile_mode": a.compile_mode if a.compile else None,
                              "gpu_mem_gib": round(mem, 2), "gpu_used_gib": round(used, 2), "step_s": step, "seq_per_s": b / step,
                              "eval_seq_per_s": b / statistics.median(eval_times), "threads": a.threads,
                              "omp": os.environ.get("OMP_NUM_THREADS"), "openblas": os.environ.get("OPENBLAS_NUM_THREADS"),
                              "flush_denormals": a.flush_denormals, "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
