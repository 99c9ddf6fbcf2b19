"""Reads the reports bench/live_bytes.cpp writes with LIVE_BYTES_DIR (one file per process)
and prints the largest process's: its live bytes at the peak by block size, and each call
stack it holds (LIVE_BYTES_BACKTRACE, LIVE_BYTES_TRACE_SIZE), one line per stack, innermost
named frame first, with frames of ATen's plumbing left out. Given a second folder (the other
side of a comparison), it prints the block sizes whose counts differ between the two peaks.

    python bench/live_bytes_report.py DIR [OTHER_DIR] [--frames 6]

Frames are named by the symbol glibc printed (demangled with c++filt) or, for a file of this
build without one (build/lib/libdtensor.so.0, build/bench/*), by addr2line.
"""
import argparse
import collections
import glob
import os
import re
import subprocess

SIZE = re.compile(r"live_bytes at peak \(pid \d+\): (\d+) x (-?\d+)")
FRAME = re.compile(r"(.*)\(([^)+]*)\+?(0x[0-9a-f]+)?\)")
PLUMBING = re.compile(r"(posix_memalign|at::(detail|_ops|native|meta|TensorIterator)|c10::|std::"
                      r"|_start|__libc"
                      r"|torch::autograd::Engine|_Py|Py[A-Z])")


def largest(folder):
    reports = {}
    for path in glob.glob(os.path.join(folder, "live_bytes.*.txt")):
        sizes = collections.Counter()
        with open(path) as f:
            lines = f.read().splitlines()
        for line in lines:
            m = SIZE.match(line)
            if m:
                sizes[int(m[1])] += int(m[2])
        reports[path] = (sizes, lines)
    if not reports:
        raise SystemExit(f"no live_bytes.*.txt in {folder} (LIVE_BYTES_HISTOGRAM and "
                         "LIVE_BYTES_DIR set?)")
    return max(reports.items(), key=lambda kv: sum(s * c for s, c in kv[1][0].items()))


def name(binary, symbol, offset, build):
    if symbol:
        return subprocess.run(["c++filt", symbol], capture_output=True, text=True).stdout.strip()
    if offset and binary.startswith(build) and os.path.exists(binary):
        out = subprocess.run(["addr2line", "-f", "-C", "-e", binary, offset],
                             capture_output=True, text=True).stdout.splitlines()
        return f"{out[0]} ({os.path.basename(out[1])})" if len(out) == 2 else ""
    return ""


def stacks(lines, build, frames):
    title, names = None, []
    for line in lines + ["live_bytes end"]:
        if line.startswith("live_bytes") and not SIZE.match(line):
            if title:
                print(f"{title} {' <- '.join(names[:frames]) or '(no named frame)'}")
            title, names = line.rstrip(":"), []
            continue
        m = FRAME.match(line)
        if title and m:
            n = name(os.path.realpath(m[1]), m[2], m[3], build)
            if n and not PLUMBING.match(n):
                names.append(re.sub(r"\(.*\)(?= |$)", "", n)[:80])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("other", nargs="?")
    p.add_argument("--frames", type=int, default=6)
    p.add_argument("--build", default="build")
    a = p.parse_args()
    path, (sizes, lines) = largest(a.folder)
    print(f"{path}: {sum(s * c for s, c in sizes.items()) / 1e6:.3f} MB live at the peak")
    if a.other:
        other_path, (other, _) = largest(a.other)
        print(f"against {other_path}: {sum(s * c for s, c in other.items()) / 1e6:.3f} MB")
        for size in sorted(set(sizes) | set(other), reverse=True):
            if sizes[size] != other[size] and abs(sizes[size] - other[size]) * size >= 4096:
                print(f"  {size:>10} bytes x {sizes[size]:>4} against {other[size]:>4}: "
                      f"{(sizes[size] - other[size]) * size / 1e6:+.3f} MB")
    else:
        for size, count in sorted(sizes.items(), reverse=True):
            if size * count >= 4096:
                print(f"  {size:>10} bytes x {count}")
    stacks(lines, os.path.realpath(a.build), a.frames)


if __name__ == "__main__":
    main()
