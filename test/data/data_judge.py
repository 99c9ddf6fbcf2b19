#!/usr/bin/env python3
"""examples/train's text data judged (meson test text_data).

usage: data_judge.py WORKER OUTDIR

Writes documents in both formats (a fortune-style file with "%" separator lines, empty
documents and non-ASCII text; a JSON lines file with a "text" field), trains a Llama-3-shaped
byte-level BPE with the `tokenizers` package, and runs the C++ worker (test/data/data_worker.cpp)
on each. Checks:
- the documents are what Python reads from the files (empty ones dropped);
- the packed stream is, for each document, <|begin_of_text|> + tokenizers' ids + <|end_of_text|>,
  one after another, and each token's document index is its document's;
- on 1, 2 and 4 data-parallel ranks: each step's global batch (the ranks' rows in rank order)
  is the same sequences whatever the rank count, each row is the stream's window of seq + 1
  tokens, and over the first epoch every sequence comes exactly once (none twice, none
  skipped);
- a run on 4 ranks stopped after 3 steps and resumed from its position on 2 ranks hands out
  the uninterrupted run's next batches, token for token;
- a malformed JSON line is refused naming the file and the line.
"""
import json
import os
import subprocess
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DOCS = [f"Fortune {i}: {text}" for i, text in enumerate([
    "A penny saved is a penny earned.", "Größe zählt nicht — oder doch?",
    "Ничто не вечно под луной.", "天下没有不散的筵席。", "Don't panic! 42 is the answer.",
    "Il n'y a pas de rose sans épines.", "Το ταξίδι είναι ο προορισμός.",
    "Every cloud has a silver lining;\nevery silver lining has a cloud.",
    "Emoji 🎉 and tabs\there.", "The early bird catches the worm, the second mouse the cheese.",
] * 4)]
SEQ, BATCH, STEPS, RESUME = 16, 8, 9, 3


def tokenizer(path):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return tok


def run(worker, tok_path, fmt, path):
    p = subprocess.run([worker, tok_path, fmt, path, str(SEQ), str(BATCH), str(STEPS),
                        str(RESUME)], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout


def check(name, cond, failures):
    if not cond:
        failures.append(name)


def judge(out, tok, want_docs, failures, label):
    bos, eos = (tok.token_to_id(s) for s in SPECIAL)
    check(f"{label}: documents", out["docs"] == want_docs, failures)
    tokens, doc_of = [], []
    for d, text in enumerate(want_docs):
        ids = [bos] + tok.encode(text, add_special_tokens=False).ids + [eos]
        tokens += ids
        doc_of += [d] * len(ids)
    check(f"{label}: packed tokens", out["tokens"] == tokens, failures)
    check(f"{label}: document of each token", out["doc_of"] == doc_of, failures)
    n = out["sequences"]
    check(f"{label}: sequence count", n == (len(tokens) - 1) // SEQ, failures)
    per_dp = {}
    for dp, ranks in out["runs"].items():
        steps = [[s for r in ranks for s in r[k]["ids"]] for k in range(STEPS)]
        per_dp[dp] = steps
        for r in ranks:
            for b in r:
                for i, s in enumerate(b["ids"]):
                    row = b["tokens"][i * (SEQ + 1):(i + 1) * (SEQ + 1)]
                    check(f"{label}: dp {dp} window of sequence {s}",
                          row == tokens[s * SEQ:s * SEQ + SEQ + 1], failures)
        order = [s for step in steps for s in step][:n]
        check(f"{label}: dp {dp}: the first epoch has every sequence once",
              sorted(order) == list(range(n)), failures)
    check(f"{label}: the same global batches on 1, 2 and 4 ranks",
          per_dp["1"] == per_dp["2"] == per_dp["4"], failures)
    resumed = [[t for r in out["resumed"] for t in r[k]["tokens"]] for k in range(STEPS - RESUME)]
    whole = [[t for r in out["runs"]["4"] for t in r[k]["tokens"]] for k in range(RESUME, STEPS)]
    check(f"{label}: resumed on 2 ranks after 3 steps on 4: the same next batches", resumed == whole,
          failures)
    print(f"{label}: {len(want_docs)} documents, {len(tokens)} tokens, {n} sequences; "
          f"{STEPS} steps of {BATCH} on 1, 2, 4 ranks and resumed")


def main():
    worker, out_dir = sys.argv[1:3]
    os.makedirs(out_dir, exist_ok=True)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    tok = tokenizer(tok_path)
    failures = []
    text_path = os.path.join(out_dir, "fortunes")
    with open(text_path, "w", encoding="utf-8") as f:
        f.write("%\n" + "\n%\n".join(DOCS[:20]) + "\n%\n   \n%\n" + "\n%\n".join(DOCS[20:]) + "\n")
    code, stdout = run(worker, tok_path, "text", text_path)
    check("text: exit 0", code == 0, failures)
    if code == 0:
        judge(json.loads(stdout), tok, [d + "\n" for d in DOCS], failures, "text")
    jsonl_path = os.path.join(out_dir, "docs.jsonl")
    with open(jsonl_path, "w", encoding="utf-8") as f:
        for i, d in enumerate(DOCS):
            f.write(json.dumps({"id": i, "text": d}, ensure_ascii=(i % 2 == 0)) + "\n")
    code, stdout = run(worker, tok_path, "jsonl", jsonl_path)
    check("jsonl: exit 0", code == 0, failures)
    if code == 0:
        judge(json.loads(stdout), tok, DOCS, failures, "jsonl")
    bad = os.path.join(out_dir, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"text": "fine"}\n{"text": 3}\n')
    code, stdout = run(worker, tok_path, "jsonl", bad)
    check("a bad JSON line is refused by file and line",
          code == 3 and "bad.jsonl:2" in stdout and '"text"' in stdout, failures)
    print(f"refused: {stdout.strip()}")
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures[:20]))
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
