"""Writes docs/conformance.md's results section from the summaries the suite leaves in
build/test/conformance/summary (one JSON per scenario and world size).

  meson test -C build --suite conformance
  .venv/bin/python test/conformance/docs.py build/test/conformance/summary --update docs/conformance.md

--update replaces what lies between the <!-- results --> and <!-- /results --> markers.
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


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--update":
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main()
        with open(sys.argv[3]) as f:
            text = f.read()
        head, rest = text.split("<!-- results -->", 1)
        _, tail = rest.split("<!-- /results -->", 1)
        with open(sys.argv[3], "w") as f:
            f.write(head + "<!-- results -->\n" + buf.getvalue() + "<!-- /results -->" + tail)
    else:
        main()
