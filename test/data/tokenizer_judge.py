#!/usr/bin/env python3
"""examples/train's tokenizer.json reader judged by the `tokenizers` package (meson test
hf_tokenizer).

usage: tokenizer_judge.py WORKER OUTDIR

Trains byte-level BPE tokenizers with `tokenizers` on a corpus of many scripts (Latin with
accents, German, Greek, Cyrillic, Chinese, Japanese, Arabic, emoji, digits, contractions, tabs,
CRLF and runs of spaces), in three shapes: GPT-2's (ByteLevel with its regex), Llama 3's
(Split with Llama 3's pattern, then ByteLevel without a regex, ignore_merges, special tokens
<|begin_of_text|> / <|end_of_text|>), and ByteLevel with add_prefix_space. Each is saved as
tokenizer.json; the C++ worker encodes held-out text (with special tokens inside) and its ids
must equal tokenizers' encode(text, add_special_tokens=False).ids, and its decode must give
the text back. A tokenizer.json with a normalizer, and one with a WordPiece model, are refused
naming the key. Exits 0 when all hold.
"""
import os
import subprocess
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]

CORPUS = [
    "The quick brown fox doesn't jump over the lazy dog; it's 2026 and we'll see.",
    "Ça coûte 12,50 € — très cher ! Où est la bibliothèque ? Élève, garçon, naïve.",
    "Größenwahn: Die Straße ist über 1000 Meter lang. Äpfel und Öl für Übermut.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "我能吞下玻璃而不伤身体。天气很好，我们去公园吧！",
    "いろはにほへと　ちりぬるを、わかよたれそ　つねならむ。カタカナも。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Emoji: 🎉🚀 naïve café 😀 — tabs\tand\tnewlines\r\nCRLF lines   with    spaces.",
    "Numbers 3.14159 and 1234567890, I'M HERE, YOU'RE THERE, THEY'VE GONE, SHE'D LEFT.",
    "    indented code: def f(x): return x ** 2  # comment\n\n\nblank lines above",
]
HELD_OUT = ("<|begin_of_text|>Größere Füchse don't sleep; ça va? 你好，世界！ 3141592653 "
            "Привет 🎉\t\tEnde.\r\n  <|end_of_text|><|begin_of_text|>It's 9:30 — "
            "naïve Ω≈ç√ «quotes»   trailing   ")


def train(shape, path):
    tok = Tokenizer(models.BPE(ignore_merges=(shape == "llama3")))
    if shape == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif shape == "prefix":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    tok.save(path)
    return tok


def run(worker, tok_path, text, out):
    text_path, dec_path = os.path.join(out, "text.txt"), os.path.join(out, "decoded.txt")
    with open(text_path, "wb") as f:
        f.write(text.encode("utf-8"))
    p = subprocess.run([worker, tok_path, text_path, dec_path], capture_output=True, text=True,
                       timeout=60)
    if p.returncode != 0:
        return None, p.stdout + p.stderr
    return [int(v) for v in p.stdout.split()], open(dec_path, "rb").read().decode("utf-8")


def main():
    worker, out = sys.argv[1:3]
    os.makedirs(out, exist_ok=True)
    ok = True
    for shape in ("gpt2", "llama3", "prefix"):
        path = os.path.join(out, f"{shape}.json")
        tok = train(shape, path)
        for name, text in (("held-out", HELD_OUT), ("corpus", "\n".join(CORPUS))):
            want = tok.encode(text, add_special_tokens=False).ids
            got, decoded = run(worker, path, text, out)
            same = got == want
            back = decoded == (text if shape != "prefix" else tok.decode(want, skip_special_tokens=False))
            print(f"{'ok' if same and back else 'FAIL'} {shape} {name}: {len(want)} ids, "
                  f"equal {same}, decode {'gives the text back' if back else repr(decoded)[:80]}")
            if not same and got is not None:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                             min(len(got), len(want)))
                print(f"  first difference at {first}: dtensor {got[first:first + 8]} "
                      f"tokenizers {want[first:first + 8]}")
            ok &= same and back
    # Refusals name the key.
    base = Tokenizer.from_file(os.path.join(out, "gpt2.json"))
    base.normalizer = normalizers.NFC()
    bad = os.path.join(out, "normalizer.json")
    base.save(bad)
    got, why = run(worker, bad, "x", out)
    ok &= got is None and "normalizer" in why
    print(f"{'ok' if got is None and 'normalizer' in why else 'FAIL'} refused: {why.strip()}")
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bad = os.path.join(out, "wordpiece.json")
    wp.save(bad)
    got, why = run(worker, bad, "a", out)
    ok &= got is None and "model.type" in why and "WordPiece" in why
    print(f"{'ok' if got is None and 'WordPiece' in why else 'FAIL'} refused: {why.strip()}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
