#!/usr/bin/env node
// Runs an ONNX model in ONNX Runtime (npm onnxruntime-node, CPU) and writes its outputs as JSON: used
// by the tests and by `bert-eval --onnx` to check exports against the project's own engine.
// Usage: node scripts/ort_run.js [--argmax | --histograms] model.onnx inputs.json outputs.json [optimized.onnx]
// inputs.json: one feed {"input_ids": {"dims": [B, T], "data": [...]}, ...} (int64 inputs), or a list
// of feeds (batches), giving a list of results. --argmax replaces every float output by the index of
// its largest value along the last axis (what accuracy needs, without moving the logits).
// --histograms returns, for every float output, a 2048-bin histogram of |x| over all batches, built as
// quant/calibrator.cpp builds it (the range starts at the first non-zero batch's max and doubles,
// merging bin pairs, when a later value exceeds it): {name: {range, max, count, bins}}.
// With BERT_ORT_TIMING=file, the time spent in session.run (JSON and conversions left out) is written
// there: {"batches", "sequences", "seconds"}, the first batch left out (bench/int8_eval.sh compares it
// with the engine's).
const path = require('path');
const fs = require('fs');
const ortPath = process.env.BERT_ORT_MODULES || path.join(__dirname, '..', 'cache', 'ort', 'node_modules', 'onnxruntime-node');
const ort = require(ortPath);

function argmaxLastAxis(t) {
  const last = t.dims[t.dims.length - 1];
  const out = new Array(t.data.length / last);
  for (let r = 0; r < out.length; ++r) {
    let best = 0;
    for (let k = 1; k < last; ++k) if (t.data[r * last + k] > t.data[r * last + best]) best = k;
    out[r] = best;
  }
  return { dims: t.dims.slice(0, -1), data: out };
}

const BINS = 2048;
function observe(h, data) {
  let batchMax = 0;
  for (let i = 0; i < data.length; ++i) {
    const a = Math.abs(data[i]);
    if (!(a <= 3.4028234663852886e38)) throw new Error('non-finite activation (NaN or Inf)');
    if (a > batchMax) batchMax = a;
  }
  h.max = Math.max(h.max, batchMax);
  h.count += data.length;
  if (batchMax === 0 && h.range === 0) { h.bins[0] += data.length; return; }
  if (h.range === 0) h.range = batchMax;
  while (batchMax > h.range) {
    for (let i = 0; i < BINS / 2; ++i) h.bins[i] = h.bins[2 * i] + h.bins[2 * i + 1];
    for (let i = BINS / 2; i < BINS; ++i) h.bins[i] = 0;
    h.range *= 2;
  }
  const inv = BINS / h.range;
  for (let i = 0; i < data.length; ++i) h.bins[Math.min(BINS - 1, Math.floor(Math.fround(Math.abs(data[i])) * inv))] += 1;
}

async function main() {
  const args = process.argv.slice(2);
  const argmax = args[0] === '--argmax';
  const histograms = args[0] === '--histograms';
  if (argmax || histograms) args.shift();
  const [model, inputsPath, outputsPath, optimizedPath] = args;
  if (!model || !inputsPath || !outputsPath) {
    console.error("usage: ort_run.js [--argmax | --histograms] model.onnx inputs.json outputs.json [optimized.onnx]");
    process.exit(2);
  }
  const options = { graphOptimizationLevel: process.env.BERT_ORT_OPTIMIZATION || 'all' };  // disabled, basic, extended, all
  if (optimizedPath) options.optimizedModelFilePath = optimizedPath;
  const session = await ort.InferenceSession.create(model, options);
  const raw = JSON.parse(fs.readFileSync(inputsPath, 'utf8'));
  const batches = Array.isArray(raw) ? raw : [raw];
  const results = [];
  const hist = {};
  const timing = { batches: 0, sequences: 0, seconds: 0 };
  let warm = false;
  for (const batch of batches) {
    const feeds = {};
    for (const [name, t] of Object.entries(batch)) feeds[name] = new ort.Tensor('int64', BigInt64Array.from(t.data.map(BigInt)), t.dims);
    const started = process.hrtime.bigint();
    const outputs = await session.run(feeds);
    if (warm) {  // the first batch is not timed (session warm-up), as bert-eval --int8 does
      timing.seconds += Number(process.hrtime.bigint() - started) / 1e9;
      timing.batches += 1;
      timing.sequences += Object.values(batch)[0].dims[0];
    }
    warm = true;
    if (histograms) {
      for (const [name, t] of Object.entries(outputs)) {
        if (t.type !== 'float32') continue;
        if (!hist[name]) hist[name] = { range: 0, max: 0, count: 0, bins: new Array(BINS).fill(0) };
        observe(hist[name], t.data);
      }
      continue;
    }
    const out = {};
    for (const [name, t] of Object.entries(outputs))
      out[name] = argmax && t.type === 'float32' ? argmaxLastAxis(t) : { dims: t.dims, data: Array.from(t.data) };
    results.push(out);
  }
  if (process.env.BERT_ORT_TIMING) fs.writeFileSync(process.env.BERT_ORT_TIMING, JSON.stringify(timing));
  if (histograms) fs.writeFileSync(outputsPath, JSON.stringify(hist));
  else fs.writeFileSync(outputsPath, JSON.stringify(Array.isArray(raw) ? results : results[0]));
}
main().catch((e) => { console.error(String(e)); process.exit(1); });
