#!/usr/bin/env python3
"""Checks that a shared library loads on an old glibc.

    check_symbols.py [--floor 2.17] LIBRARY...

The shim is preloaded into other people's programs, on whatever glibc their
image has: it may ask for no GLIBC_ symbol version newer than the floor, and
may need no library beyond glibc's own (a library the image lacks, or one of
glibc's from a newer release, stops every program in the container). Reads
the dynamic symbol table with `objdump -T` and DT_NEEDED with `readelf -d`
(binutils). Prints what it found; exits 1 naming each offending symbol and
library.
"""

import argparse
import re
import subprocess
import sys
from collections import defaultdict

# glibc's own libraries and the x86-64 dynamic loader. libgcc_s is not here:
# the zig-linked build carries its own unwinder, and libgcc_s is not part of
# glibc (a minimal image may lack it).
ALLOWED_NEEDED = {
    "libc.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libm.so.6",
    "ld-linux-x86-64.so.2",
}

# An undefined (required) symbol: `0000000000000000  w  DF *UND*  0000000000000000 (GLIBC_2.34) name`.
# objdump puts the version in parentheses when it is hidden, bare otherwise.
UNDEFINED = re.compile(r"\*UND\*\s+[0-9a-fA-F]+\s+\(?GLIBC_([^)\s]+)\)?\s+(\S+)\s*$")
NUMERIC = re.compile(r"\d+(?:\.\d+)+")
NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]")


def version_tuple(text):
    return tuple(int(part) for part in text.split("."))


def tool(argv):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        sys.exit(f"{argv[0]} not found: install binutils")
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr.strip()}")
    return done.stdout


def check(library, floor):
    """Returns (report lines, problem lines) for one library."""
    required = defaultdict(list)
    for line in tool(["objdump", "-T", library]).splitlines():
        if "*UND*" not in line or "GLIBC_" not in line:
            continue
        found = UNDEFINED.search(line)
        if not found:
            # A format this script does not read must not pass as "nothing newer".
            sys.exit(f"cannot read this objdump -T line of {library}:\n{line}")
        required[found.group(1)].append(found.group(2))
    needed = NEEDED.findall(tool(["readelf", "-d", library]))

    report, problems = [], []
    # GLIBC_PRIVATE and the like: glibc's internals, which change in every release.
    for version in sorted(v for v in required if not NUMERIC.fullmatch(v)):
        problems.append(
            f"{library} needs GLIBC_{version}, not a released version, for: {', '.join(required.pop(version))}"
        )
    if required:
        highest = max(required, key=version_tuple)
        report.append(f"{library}: highest glibc symbol version GLIBC_{highest} (floor {floor})")
    else:
        report.append(f"{library}: no versioned glibc symbols")
    report.append(f"{library}: needs {', '.join(needed) or 'no libraries'}")
    for version in sorted(required, key=version_tuple):
        if version_tuple(version) > version_tuple(floor):
            symbols = ", ".join(sorted(set(required[version])))
            problems.append(f"{library} needs GLIBC_{version}, newer than the {floor} floor, for: {symbols}")
    for name in needed:
        if name not in ALLOWED_NEEDED:
            problems.append(
                f"{library} needs {name}, which is not one of glibc's libraries ({', '.join(sorted(ALLOWED_NEEDED))})"
            )
    return report, problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floor", default="2.17", help="the oldest glibc to load on (default: %(default)s)")
    parser.add_argument("libraries", nargs="+")
    args = parser.parse_args()
    failed = False
    for library in args.libraries:
        report, problems = check(library, args.floor)
        print("\n".join(report))
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        failed = failed or bool(problems)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
