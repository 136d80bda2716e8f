#!/usr/bin/env python3
"""Reference answers for the entropy calibrator (tests/fixtures/entropy_reference.json).

compute_amax_entropy below is pytorch-quantization's HistogramCalibrator._compute_amax_entropy (the method of
TensorRT's entropy calibrator) transcribed with numpy/scipy as it is written there, stride 1, start bin 128,
8 bits signed. It runs on a few deterministic 2048-bin |x| histograms; the C++ test feeds the same bins to
quant::AbsHistogram and expects the same amax. Needs python3-numpy and python3-scipy (not build
dependencies). Run with Debian's Python: /usr/bin/python3 tests/golden/make_entropy_fixture.py
"""
import json
import os
from collections import Counter

import numpy as np
from scipy.stats import entropy

BINS = 2048


def compute_amax_entropy(calib_hist, calib_bin_edges, num_bits=8, unsigned=False, stride=1, start_bin=128):
    def _normalize_distr(distr):
        summ = np.sum(distr)
        if summ != 0:
            distr = distr / summ
        return distr

    bins = calib_hist[:]
    bins[0] = bins[1]
    total_data = np.sum(bins)
    divergences = []
    arguments = []
    nbins = 1 << (num_bits - 1 + int(unsigned))
    starting = start_bin
    stop = len(bins)
    new_density_counts = np.zeros(nbins, dtype=np.float64)
    for i in range(starting, stop + 1, stride):
        new_density_counts.fill(0)
        space = np.linspace(0, i, num=nbins + 1)
        digitized_space = np.digitize(range(i), space) - 1
        digitized_space[bins[:i] == 0] = -1
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density_counts[digitized] += bins[idx]
        counter = Counter(digitized_space)
        for key, val in counter.items():
            if key != -1:
                new_density_counts[key] = new_density_counts[key] / val
        new_density = np.zeros(i, dtype=np.float64)
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density[idx] = new_density_counts[digitized]
        total_counts_new = np.sum(new_density) + np.sum(bins[i:])
        new_density = _normalize_distr(new_density)
        reference_density = np.array(bins[:len(digitized_space)], dtype=np.float64)
        reference_density[-1] += np.sum(bins[i:])
        total_counts_old = np.sum(reference_density)
        if round(total_counts_new) != total_data or round(total_counts_old) != total_data:
            raise RuntimeError("count mismatch")
        reference_density = _normalize_distr(reference_density)
        divergences.append(entropy(reference_density, new_density))
        arguments.append(i)
    divergences = np.array(divergences)
    last_argmin = len(divergences) - 1 - np.argmin(divergences[::-1])
    return calib_bin_edges[last_argmin * stride + starting]


def histogram(samples, value_range):
    counts, _ = np.histogram(np.abs(samples), bins=BINS, range=(0, value_range))
    return counts.astype(np.float64)


def main():
    rng = np.random.default_rng(7)
    cases = {}
    n = 200_000
    # A spike of exact zeros (softmax over padded keys) plus probabilities up to 0.95: amax near the top.
    probs = np.concatenate([np.zeros(n // 4), rng.beta(0.3, 3.0, size=n - n // 4 - 200), rng.uniform(0.8, 0.95, 200)])
    cases["zero_spike_and_tail"] = (probs, 0.95)
    cases["normal"] = (rng.normal(size=n), None)
    outliers = rng.normal(size=n)
    outliers[:40] *= 40
    cases["normal_with_outliers"] = (outliers, None)
    cases["laplace"] = (rng.laplace(size=n), None)
    cases["uniform"] = (rng.uniform(-1, 1, size=n), None)
    sparse = rng.normal(size=n // 20)  # few samples: many empty bins
    cases["sparse_normal"] = (sparse, None)
    # Attention probabilities as a trained BERT makes them: rows of softmax over 128 keys, most heads
    # diffuse, one row in eight peaked on a single key (a [CLS]/[SEP] or previous-token head). Bounded by 1;
    # entropy clips the peaks (the quantity the model uses) to fit the diffuse bulk.
    rows = 2000
    logits = rng.normal(size=(rows, 128))
    peaked = rng.uniform(size=rows) < 0.125
    logits[peaked, rng.integers(0, 128, size=peaked.sum())] += 9.0
    attention = np.exp(logits - logits.max(axis=1, keepdims=True))
    attention /= attention.sum(axis=1, keepdims=True)
    cases["attention_probs"] = (attention.ravel(), None)
    out = {"bins": BINS, "cases": []}
    for name, (samples, top) in cases.items():
        value_range = float(top if top is not None else np.abs(samples).max())
        counts = histogram(samples, value_range)
        edges = np.linspace(0, value_range, BINS + 1)
        amax = float(compute_amax_entropy(counts.copy(), edges))
        out["cases"].append({"name": name, "range": value_range, "count": int(counts.sum()),
                             "bins": [int(c) for c in counts], "amax": amax})
        print(f"{name}: range {value_range:.4f}, entropy amax {amax:.6f} ({amax / value_range:.3f} of the range)")
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "entropy_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote", os.path.normpath(path))


if __name__ == "__main__":
    main()
