#!/usr/bin/env node
// Runs an ONNX model in ONNX Runtime (npm onnxruntime-node, CPU) and writes its outputs as JSON: used
// by the tests and by `bert-eval --onnx` to check exports against the project's own engine.
// Usage: node scripts/ort_run.js [--argmax | --stream] model.onnx inputs.json outputs.json [optimized.onnx]
// inputs.json: one feed {"input_ids": {"dims": [B, T], "data": [...]}, ...} (int64 inputs), or a list
// of feeds (batches), giving a list of results. --argmax replaces every float output by the index of
// its largest value along the last axis (what accuracy needs, without moving the logits).
// --stream sends every float output back as binary tensors instead (see streamTensor; the TensorRT
// cache's calibration reads them into its histograms as they come) and writes {} to outputs.json.
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

// --stream: every float32 output of every batch, as raw bytes on file descriptor 3 (a pipe the caller
// reads while this runs), one message per tensor: uint32 batch, uint32 name length, the name (UTF-8),
// uint64 element count, the float32 values; all little-endian. Memory stays one batch's outputs.
const STREAM_FD = 3;
function writeAll(buffer) {
  for (let done = 0; done < buffer.length;) {
    try {
      done += fs.writeSync(STREAM_FD, buffer, done, buffer.length - done);
    } catch (e) {
      if (e.code !== 'EAGAIN') throw e;  // a full pipe: the reader is busy, try again
    }
  }
}
function streamTensor(batch, name, data) {
  const nameBytes = Buffer.from(name, 'utf8');
  const header = Buffer.alloc(16 + nameBytes.length);
  header.writeUInt32LE(batch, 0);
  header.writeUInt32LE(nameBytes.length, 4);
  nameBytes.copy(header, 8);
  header.writeBigUInt64LE(BigInt(data.length), 8 + nameBytes.length);
  writeAll(header);
  writeAll(Buffer.from(data.buffer, data.byteOffset, data.byteLength));
}

async function main() {
  const args = process.argv.slice(2);
  const argmax = args[0] === '--argmax';
  const stream = args[0] === '--stream';
  if (argmax || stream) args.shift();
  const [model, inputsPath, outputsPath, optimizedPath] = args;
  if (!model || !inputsPath || !outputsPath) {
    console.error("usage: ort_run.js [--argmax | --stream] model.onnx inputs.json outputs.json [optimized.onnx]");
    process.exit(2);
  }
  const options = { graphOptimizationLevel: process.env.BERT_ORT_OPTIMIZATION || 'all' };  // disabled, basic, extended, all
  if (optimizedPath) options.optimizedModelFilePath = optimizedPath;
  const session = await ort.InferenceSession.create(model, options);
  const raw = JSON.parse(fs.readFileSync(inputsPath, 'utf8'));
  const batches = Array.isArray(raw) ? raw : [raw];
  const results = [];
  const timing = { batches: 0, sequences: 0, seconds: 0 };
  let warm = false;
  for (const [index, batch] of batches.entries()) {
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
    if (stream) {
      for (const [name, t] of Object.entries(outputs)) if (t.type === 'float32') streamTensor(index, name, t.data);
      continue;
    }
    const out = {};
    for (const [name, t] of Object.entries(outputs))
      out[name] = argmax && t.type === 'float32' ? argmaxLastAxis(t) : { dims: t.dims, data: Array.from(t.data) };
    results.push(out);
  }
  if (process.env.BERT_ORT_TIMING) fs.writeFileSync(process.env.BERT_ORT_TIMING, JSON.stringify(timing));
  if (stream) fs.writeFileSync(outputsPath, '{}');
  else fs.writeFileSync(outputsPath, JSON.stringify(Array.isArray(raw) ? results : results[0]));
}
main().catch((e) => { console.error(String(e)); process.exit(1); });
