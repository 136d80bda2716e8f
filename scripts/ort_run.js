#!/usr/bin/env node
// Runs an ONNX model in ONNX Runtime (npm onnxruntime-node, CPU) and writes its outputs as JSON: used
// by the tests and by `bert-eval --onnx` to check exports against the project's own engine.
// Usage: node scripts/ort_run.js [--argmax] model.onnx inputs.json outputs.json [optimized.onnx]
// inputs.json: one feed {"input_ids": {"dims": [B, T], "data": [...]}, ...} (int64 inputs), or a list
// of feeds (batches), giving a list of results. --argmax replaces every float output by the index of
// its largest value along the last axis (what accuracy needs, without moving the logits).
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

async function main() {
  const args = process.argv.slice(2);
  const argmax = args[0] === '--argmax';
  if (argmax) args.shift();
  const [model, inputsPath, outputsPath, optimizedPath] = args;
  if (!model || !inputsPath || !outputsPath) {
    console.error('usage: ort_run.js [--argmax] model.onnx inputs.json outputs.json [optimized.onnx]');
    process.exit(2);
  }
  const options = { graphOptimizationLevel: 'all' };
  if (optimizedPath) options.optimizedModelFilePath = optimizedPath;
  const session = await ort.InferenceSession.create(model, options);
  const raw = JSON.parse(fs.readFileSync(inputsPath, 'utf8'));
  const batches = Array.isArray(raw) ? raw : [raw];
  const results = [];
  for (const batch of batches) {
    const feeds = {};
    for (const [name, t] of Object.entries(batch)) feeds[name] = new ort.Tensor('int64', BigInt64Array.from(t.data.map(BigInt)), t.dims);
    const outputs = await session.run(feeds);
    const out = {};
    for (const [name, t] of Object.entries(outputs))
      out[name] = argmax && t.type === 'float32' ? argmaxLastAxis(t) : { dims: t.dims, data: Array.from(t.data) };
    results.push(out);
  }
  fs.writeFileSync(outputsPath, JSON.stringify(Array.isArray(raw) ? results : results[0]));
}
main().catch((e) => { console.error(String(e)); process.exit(1); });
