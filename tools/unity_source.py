#!/usr/bin/env python3
"""Writes one unity translation unit: tools/unity_source.py OUTPUT SOURCE...

Each SOURCE is included by its path relative to OUTPUT's directory, so the unit's text is
the same in every clone and ccache (with CCACHE_BASEDIR) hits across clones ([Note: unity
units] in lib/meson.build). The file is rewritten only when its text changes.
"""
import os
import sys


def main():
    out, sources = sys.argv[1], sys.argv[2:]
    here = os.path.dirname(os.path.abspath(out))
    text = "".join(
        '#include "{}"\n'.format(os.path.relpath(os.path.abspath(s), here).replace(os.sep, "/"))
        for s in sources)
    if os.path.exists(out):
        with open(out) as f:
            if f.read() == text:
                return
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
