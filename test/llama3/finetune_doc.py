#!/usr/bin/env python3
"""docs/finetune.md's walkthrough, run as written (meson test finetune_doc-w8).

usage: finetune_doc.py SOURCE_ROOT TORCHRUN TRAIN OUTDIR
The bash block after the line `<!-- test: finetune walkthrough` in docs/finetune.md runs from
the source root with OUT=OUTDIR and TRAIN=TRAIN (the block's own defaults otherwise), under
`bash -e`: transformers writes a small Llama and a tokenizer in several shards, the recipe
fine-tunes it on 8 ranks (pp 2 x dp_shard 2 x tp 2) and exports it, and transformers and
tokenizers load the export (the block asserts the tokenizer's ids itself). Then, judged here:
the loss transformers computes on the text is lower for the export than for the base; the
export is sharded like the base (the same files, the same tensors in each) with the index,
config.json, generation_config.json and the tokenizer's files; the recipe's loss fell.
"""
import json
import os
import re
import subprocess
import sys

MARK = "<!-- test: finetune walkthrough"


def walkthrough(root):
    text = open(os.path.join(root, "docs", "finetune.md")).read()
    after = text[text.index(MARK):]
    block = re.search(r"```bash\n(.*?)```", after, re.S)
    assert block, "docs/finetune.md: no bash block after the walkthrough's mark"
    return block.group(1)


def index_of(folder):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


def main():
    root, torchrun, train, out = sys.argv[1:5]
    train, out = os.path.abspath(train), os.path.abspath(out)  # the block runs from the root
    script = walkthrough(root)
    env = dict(os.environ, OUT=out, TRAIN=train, OMP_NUM_THREADS="1",
               PATH=os.path.dirname(torchrun) + os.pathsep + os.environ["PATH"])
    p = subprocess.run(["bash", "-e", "-c", script], cwd=root, env=env, capture_output=True,
                       text=True, timeout=500)
    print(p.stdout[-3000:])
    if p.returncode != 0:
        print(p.stderr[-4000:])
        sys.exit(f"FAIL: the walkthrough exited {p.returncode}")
    ok = True
    losses = dict(re.findall(r"^(\S+): LlamaForCausalLM, loss ([0-9.]+)$", p.stdout, re.M))
    base, tuned = os.path.join(out, "base"), os.path.join(out, "tuned")
    fell = len(losses) == 2 and float(losses[tuned]) < float(losses[base]) - 0.3
    print(f"{'ok' if fell else 'FAIL'}: transformers' loss {losses.get(base)} (base) -> "
          f"{losses.get(tuned)} (export)")
    ok &= fell
    want, got = index_of(base), index_of(tuned)
    same = want == got and len(set(got.values())) > 1
    print(f"{'ok' if same else 'FAIL'}: the export's {len(set(got.values()))} files hold the "
          f"tensors save_pretrained's {len(set(want.values()))} hold")
    ok &= same
    files = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    present = files <= set(os.listdir(tuned))
    with open(os.path.join(tuned, "config.json")) as f:
        arch = json.load(f)["architectures"]
    print(f"{'ok' if present and arch == ['LlamaForCausalLM'] else 'FAIL'}: {sorted(files)} "
          f"written, architectures {arch}")
    ok &= present and arch == ["LlamaForCausalLM"]
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    trained = len(steps) == 20 and steps[-1]["loss"] < steps[0]["loss"]
    print(f"{'ok' if trained else 'FAIL'}: the recipe's loss {steps[0]['loss']:.3f} -> "
          f"{steps[-1]['loss']:.3f} over {len(steps)} steps")
    ok &= trained
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
