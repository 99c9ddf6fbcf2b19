"""Writes docs/conformance.md's results section from the summaries the suite leaves in
build/test/conformance/summary (one JSON per scenario and world size).

  meson test -C build --suite conformance
  .venv/bin/python test/conformance/docs.py build/test/conformance/summary --update docs/conformance.md

--update replaces what lies between the <!-- results --> and <!-- /results --> markers.
The operator sweep's summaries (scripts/sweep.sh) fill the <!-- sweep --> section:

  .venv/bin/python test/conformance/docs.py DIR --sweep docs/conformance.md
"""
import contextlib
import io
import collections
import glob
import json
import os
import sys

ORDER = ["redistribute", "ops", "submesh", "tp", "fsdp", "clip", "misuse", "factories"]
COLUMNS = ["identical", "within tolerance", "both raise", "dtensor right, PyTorch raises",
           "dtensor right, PyTorch wrong", "by design"]


def main():
    directory = sys.argv[1]
    rows = {}
    reasons = collections.Counter()
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            data = json.load(f)
        if data["scenario"].startswith("sweep"):
            continue  # per overload, not per record: sweep_table()
        counts = collections.Counter()
        for outcome, n in data["tally"].items():
            if outcome.startswith("by design: "):
                counts["by design"] += n
                reasons[(data["scenario"], outcome[len("by design: "):])] += n
            else:
                counts[outcome] += n
        rows[(data["scenario"], data["world"])] = counts
    print("| scenario | ranks | records | " + " | ".join(COLUMNS) + " | differs |")
    print("|---|---|---|" + "---|" * (len(COLUMNS) + 1))
    total = collections.Counter()
    for (scenario, world) in sorted(rows, key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER
                                                        else 99, k[1])):
        c = rows[(scenario, world)]
        differs = sum(n for o, n in c.items() if o.startswith("DIFFERS"))
        total.update(c)
        print(f"| {scenario} | {world} | {sum(c.values())} | " +
              " | ".join(str(c.get(col, 0)) for col in COLUMNS) + f" | {differs} |")
    differs = sum(n for o, n in total.items() if o.startswith("DIFFERS"))
    print(f"| **all** | | {sum(total.values())} | " +
          " | ".join(str(total.get(col, 0)) for col in COLUMNS) + f" | {differs} |")
    print()
    print("Differences by design (records, summed over 1, 2 and 4 ranks):")
    print()
    for (scenario, reason), n in sorted(reasons.items(), key=lambda kv: (kv[0][0], -kv[1])):
        print(f"- **{scenario}** ({n}): {reason}")


STATUS = {"right": 0, "raises": 1, "wrong": 2}


def _status(counts):
    if counts.get("wrong"):
        return "wrong"
    return "right" if set(counts) - {"not run"} == {"right"} else "raises"


def sweep_table():
    """Every overload of the sweep summaries in DIR, merged over world sizes (a side is right
    on an overload when it is right on every case of every run)."""
    runs, merged = [], {}
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "sweep*.json"))):
        with open(path) as f:
            data = json.load(f)
        runs.append(f"{data['scenario']} on {data['world']} ranks")
        for op, o in data["overloads"].items():
            m = merged.setdefault(op, {"dtensor": "right", "torch": "right", "cases": 0, "why": ""})
            m["cases"] += o["cases"]
            for side in ("dtensor", "torch"):
                st = _status(o[side])
                if STATUS[st] > STATUS[m[side]]:
                    m[side] = st
            if not m["why"] and o["why"]:
                m["why"] = o["why"]
    n = len(merged)
    d_right = sum(1 for m in merged.values() if m["dtensor"] == "right")
    t_right = sum(1 for m in merged.values() if m["torch"] == "right")
    t_only = sorted(op for op, m in merged.items() if m["torch"] == "right" and m["dtensor"] != "right")
    print(f"Runs: {', '.join(runs)}. {n} overloads, {sum(m['cases'] for m in merged.values())} "
          f"cases. dtensor right on {d_right} ({100.0 * d_right / n:.1f}%), PyTorch "
          f"{torch_version()} on {t_right} ({100.0 * t_right / n:.1f}%); right in PyTorch "
          f"and not in dtensor: {', '.join(t_only) or 'none'}.")
    print()
    print("| overload | dtensor | PyTorch | cases | first case dtensor is not right on |")
    print("|---|---|---|---|---|")
    for op in sorted(merged):
        m = merged[op]
        why = m["why"].replace("|", "/")[:160] if m["dtensor"] != "right" else ""
        print(f"| `{op}` | {m['dtensor']} | {m['torch']} | {m['cases']} | {why} |")


def torch_version():
    import torch  # noqa: PLC0415 - only for the table's header line
    return torch.__version__.split("+")[0]


def _replace(path, marker, text):
    with open(path) as f:
        doc = f.read()
    head, rest = doc.split(f"<!-- {marker} -->", 1)
    _, tail = rest.split(f"<!-- /{marker} -->", 1)
    with open(path, "w") as f:
        f.write(head + f"<!-- {marker} -->\n" + text + f"<!-- /{marker} -->" + tail)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] in ("--update", "--sweep"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            (main if sys.argv[2] == "--update" else sweep_table)()
        _replace(sys.argv[3], "results" if sys.argv[2] == "--update" else "sweep", buf.getvalue())
    else:
        main()
