#!/usr/bin/env python3
"""Where the test command's time goes, from any build directory.

    scripts/test_times.py [BUILD_DIR ...] [--top N] [--summary]

Reads each build directory's meson-logs/testlog.json (per test: duration, result, and the
Catch2 counts of test cases and assertions its output reports) and .ninja_log (per object:
compile time; the newest entry of each output counts). Prints markdown tables: the suites'
test-seconds, the programs' (a program's worldN runs summed), the slowest tests, and compile
seconds per target. --summary prints one line instead: test-seconds, wall time of the run,
and the slowest five programs (scripts/test.sh ends with it). The tables in docs/testing.md
("Budget") come from this script.
"""
import argparse
import json
import os
import re
import sys
from collections import defaultdict

CATCH_PASSED = re.compile(r"All tests passed \((\d+) assertions? in (\d+) test cases?\)")
CATCH_FAILED = re.compile(r"test cases:\s*(\d+).*?\nassertions:\s*(\d+)", re.S)


def program_of(test_name):
    """'dtensor:world2 / fully_shard-w2' -> 'fully_shard'."""
    name = test_name.split(" / ", 1)[-1]
    return re.sub(r"-w\d+$", "", name)


def suites_of(test_name):
    prefix = test_name.split(" / ", 1)[0]
    return prefix.split(":", 1)[-1].split("+") if ":" in prefix else [prefix]


def read_tests(build):
    path = os.path.join(build, "meson-logs", "testlog.json")
    if not os.path.exists(path):
        return []
    tests = []
    for line in open(path):
        r = json.loads(line)
        out = r.get("stdout") or ""
        cases = assertions = None
        m = CATCH_PASSED.search(out) or CATCH_FAILED.search(out)
        if m:
            assertions, cases = (int(m.group(1)), int(m.group(2))) if m.re is CATCH_PASSED else (
                int(m.group(2)), int(m.group(1)))
        tests.append({
            "name": r["name"],
            "program": program_of(r["name"]),
            "suites": suites_of(r["name"]),
            "duration": float(r.get("duration") or 0.0),
            "start": float(r.get("starttime") or 0.0),
            "result": r.get("result"),
            "cases": cases,
            "assertions": assertions,
        })
    return tests


def target_of(output):
    """'test/test_fsdp.p/test_fsdp.cpp.o' -> 'test/test_fsdp'; links keep their name."""
    m = re.match(r"(.*?)(?:\.p)?/[^/]*\.o$", output)
    if m and ".p/" in output:
        return output.split(".p/", 1)[0]
    return output


def read_builds(build):
    path = os.path.join(build, ".ninja_log")
    if not os.path.exists(path):
        return {}
    newest = {}
    for line in open(path):
        if line.startswith("#"):
            continue
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 4:
            continue
        start, end, _mtime, output = int(parts[0]), int(parts[1]), parts[2], parts[3]
        newest[output] = (end - start) / 1000.0
    per_target = defaultdict(float)
    for output, seconds in newest.items():
        if output.endswith(".o"):
            per_target[target_of(output)] += seconds
    return per_target


def table(rows, header):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def report(build, top):
    tests = read_tests(build)
    lines = [f"## {build}", ""]
    if tests:
        wall = max(t["start"] + t["duration"] for t in tests) - min(t["start"] for t in tests)
        total = sum(t["duration"] for t in tests)
        lines.append(f"{len(tests)} tests, {total:.0f} test-seconds, {wall:.0f} s wall "
                     f"({sum(t['result'] not in ('OK', 'EXPECTEDFAIL') for t in tests)} not OK)")
        lines.append("")
        suites = defaultdict(lambda: [0, 0.0])
        for t in tests:
            for s in t["suites"]:
                suites[s][0] += 1
                suites[s][1] += t["duration"]
        lines.append(table(sorted(([s, n, f"{d:.0f}"] for s, (n, d) in suites.items()),
                                  key=lambda r: -float(r[2])),
                           ["suite", "tests", "test-seconds"]))
        lines.append("")
        programs = defaultdict(lambda: {"runs": 0, "seconds": 0.0, "cases": 0, "assertions": 0})
        for t in tests:
            p = programs[t["program"]]
            p["runs"] += 1
            p["seconds"] += t["duration"]
            p["cases"] += t["cases"] or 0
            p["assertions"] += t["assertions"] or 0
        rows = sorted(programs.items(), key=lambda kv: -kv[1]["seconds"])
        lines.append(table([[name, p["runs"], f"{p['seconds']:.1f}", p["cases"], p["assertions"]]
                            for name, p in rows[:top]],
                           ["program", "runs", "test-seconds", "test cases", "assertions"]))
        lines.append("")
        lines.append(table([[t["name"], f"{t['duration']:.1f}", t["result"]]
                            for t in sorted(tests, key=lambda t: -t["duration"])[:top]],
                           ["slowest tests", "seconds", "result"]))
        lines.append("")
    builds = read_builds(build)
    if builds:
        lines.append(f"compile: {sum(builds.values()):.0f} CPU-seconds over {len(builds)} targets "
                     "(newest object of each output)")
        lines.append("")
        lines.append(table([[t, f"{s:.0f}"] for t, s in sorted(builds.items(), key=lambda kv: -kv[1])[:top]],
                           ["target", "compile CPU-seconds"]))
        lines.append("")
    return "\n".join(lines)


def summary(build):
    tests = read_tests(build)
    if not tests:
        return f"{build}: no test log"
    wall = max(t["start"] + t["duration"] for t in tests) - min(t["start"] for t in tests)
    programs = defaultdict(float)
    for t in tests:
        programs[t["program"]] += t["duration"]
    slowest = sorted(programs.items(), key=lambda kv: -kv[1])[:5]
    return (f"{len(tests)} tests in {wall:.0f} s wall ({sum(programs.values()):.0f} test-seconds); "
            "slowest programs: " + ", ".join(f"{p} {s:.0f} s" for p, s in slowest))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="*", default=["build"])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--summary", action="store_true")
    args = ap.parse_args()
    for b in args.builds:
        print(summary(b) if args.summary else report(b, args.top))


if __name__ == "__main__":
    sys.exit(main())
