#!/usr/bin/env node
// Runs an ONNX model in ONNX Runtime (npm onnxruntime-node, CPU) on inputs from a JSON file and writes
// the outputs as JSON: used by the tests to check exports against the project's own engine.
// Usage: node scripts/ort_run.js model.onnx inputs.json outputs.json [optimized.onnx]
// inputs.json: {"input_ids": {"dims": [B, T], "data": [...]}, ...} (int64 inputs)
const path = require('path');
const fs = require('fs');
const ortPath = process.env.BERT_ORT_MODULES || path.join(__dirname, '..', 'cache', 'ort', 'node_modules', 'onnxruntime-node');
const ort = require(ortPath);

async function main() {
  const [model, inputsPath, outputsPath, optimizedPath] = process.argv.slice(2);
  if (!model || !inputsPath || !outputsPath) {
    console.error('usage: ort_run.js model.onnx inputs.json outputs.json [optimized.onnx]');
    process.exit(2);
  }
  const options = { graphOptimizationLevel: 'all' };
  if (optimizedPath) options.optimizedModelFilePath = optimizedPath;
  const session = await ort.InferenceSession.create(model, options);
  const raw = JSON.parse(fs.readFileSync(inputsPath, 'utf8'));
  const feeds = {};
  for (const [name, t] of Object.entries(raw)) feeds[name] = new ort.Tensor('int64', BigInt64Array.from(t.data.map(BigInt)), t.dims);
  const results = await session.run(feeds);
  const out = {};
  for (const [name, t] of Object.entries(results)) out[name] = { dims: t.dims, data: Array.from(t.data) };
  fs.writeFileSync(outputsPath, JSON.stringify(out));
}
main().catch((e) => { console.error(String(e)); process.exit(1); });
