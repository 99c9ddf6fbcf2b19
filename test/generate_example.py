"""examples/generate on 4 ranks: 2 train with FSDP on a sentence repeated, 2 generate on TP 2
after dtensor::reshard. Guards the example end to end: the training loss fell, the generator
received the weights (bytes > 0), and every prompt's greedy continuation is the sentence's
own (the prompt and its continuation a piece of the repeated text), which only the trained
weights, moved intact, produce."""
import os
import re
import subprocess
import sys

TEXT = "the quick brown fox jumps over the lazy dog. "


def main():
    torchrun, example = sys.argv[1:3]
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node=4", "--no-python", example],
                       capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(p.stdout)
    if p.returncode != 0:
        print(p.stderr[-3000:])
        return 1
    ok = True
    loss = re.search(r"loss (\d+\.\d+)", p.stdout)
    moved = re.search(r"(\d+) bytes received by reshard", p.stdout)
    if not loss or float(loss.group(1)) > 0.1:
        print("FAIL the trainers' loss did not fall below 0.1")
        ok = False
    if not moved or int(moved.group(1)) == 0:
        print("FAIL the generator received no bytes")
        ok = False
    lines = [l for l in p.stdout.splitlines() if "|" in l]
    if len(lines) != 3:
        print(f"FAIL {len(lines)} continuations, not 3")
        ok = False
    for line in lines:
        prompt, continuation = line.split("|", 1)
        if (prompt + continuation) not in TEXT * 4:
            print(f"FAIL '{prompt}' continued as '{continuation}', not as the sentence")
            ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
