#!/usr/bin/env python3
"""Compiles a precompiled header with the flags of one target's own units.

    tools/pch.py COMPILE_COMMANDS LIKE HEADER STUB GCH STAMP DEPFILE

LIKE is the start of an object path in COMPILE_COMMANDS (relative to the build directory,
for example "test/test_process_group.p/"); the first unit whose output starts with it gives
the compiler and every flag. The script writes STUB (a header that includes HEADER by its
relative path, so its text is the same in every clone), compiles it to GCH (beside STUB,
where GCC looks for it) from HEADER, writes DEPFILE for ninja, and rewrites STAMP, a header the units
include after the precompiled one so that their own dependency files name it: GCC leaves a
precompiled header and everything in it out of a unit's dependencies, and ninja would
otherwise keep objects compiled against an older one. [Note: precompiled headers] in
meson.build.
"""
import json
import os
import shlex
import subprocess
import sys

# Flags of the template unit that name its own object, dependency file or source.
DROP_WITH_VALUE = {"-MQ", "-MF", "-MT", "-o", "-c", "-include"}
DROP = {"-MD", "-MMD"}


def template(compile_commands, like):
    with open(compile_commands) as f:
        entries = json.load(f)
    for e in entries:
        if e.get("output", "").startswith(like):
            return e
    sys.exit("tools/pch.py: no unit in {} has an output starting with '{}'".format(
        compile_commands, like))


def flags_of(command):
    args, out, skip = shlex.split(command), [], False
    for a in args:
        if skip:
            skip = False
        elif a in DROP_WITH_VALUE:
            skip = True
        elif a not in DROP:
            out.append(a)
    return out


def main():
    compile_commands, like, header, stub, gch, stamp, depfile = sys.argv[1:8]
    entry = template(compile_commands, like)
    here = os.path.dirname(os.path.abspath(stub))
    rel = os.path.relpath(os.path.abspath(header), here).replace(os.sep, "/")
    # Written on every run: ninja reruns a step whose outputs are older than its inputs.
    with open(stub, "w") as f:
        f.write('#include "{}"\n'.format(rel))
    # Paths relative to the build directory, as in the units' own commands: ccache then
    # sees the same command line in every clone.
    def rel_to_build(p):
        return os.path.relpath(os.path.abspath(p), entry["directory"])
    # The header itself is compiled (GCC takes STUB.gch for STUB whatever it was compiled
    # from), so that the dependency file names sources only, never an output of this step.
    cmd = flags_of(entry["command"]) + [
        "-x", "c++-header", rel_to_build(header), "-o", rel_to_build(gch),
        "-MD", "-MF", rel_to_build(depfile), "-MQ", rel_to_build(stub)]
    rc = subprocess.run(cmd, cwd=entry["directory"]).returncode
    if rc != 0:
        sys.exit(rc)
    # Rewritten on every run, so that ninja rebuilds the units after a new header.
    with open(stamp, "w") as f:
        f.write("// compiled after {}: tools/pch.py\n".format(os.path.basename(gch)))


if __name__ == "__main__":
    main()
