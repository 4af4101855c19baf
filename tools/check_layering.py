#!/usr/bin/env python3
"""Checks the direction of the includes between ferry's packages: a package
may include only from the packages below it (docs/style.md, "The package
arrows"). Reads every #include "..." of the product code.

    tools/check_layering.py [--check]

Prints each arrow that runs the wrong way (file, line, what it includes)
and a summary; with --check exits 1 if there is any.

The layers, bottom up, are ALLOWED below: a package may include itself
and the packages listed for it. Inside daemon/, each folder is a package of
its own ("daemon/versions", ...) whose arrows daemon/layers.bzl lists (the
same table gives Bazel's visibility); the root daemon/ (main.cc, server)
may include all of them, and a package allowed "daemon" may include any.
"""

import argparse
import ast
import os
import re
import sys

# package -> the packages it may include (besides itself). The test code,
# benchmarks, examples and fuzz targets may include anything.
ALLOWED = {
    "common": set(),
    "core": set(),
    "proto": {"core", "common"},
    "checkpoint": {"core", "common"},
    "transport": {"core", "common"},
    "cuda": {"core", "common", "proto", "transport"},
    "client": {"core", "common", "proto", "transport", "checkpoint"},
    "daemon": {"core", "common", "proto", "transport", "checkpoint", "cuda"},
    "python": {"core", "common", "proto"},
    "tools": {"core", "common", "proto", "transport", "checkpoint", "client",
              "daemon", "cuda"},
}
FREE = {"tests", "bench", "examples", "third_party"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def daemon_layers():
    """DAEMON_LAYERS of daemon/layers.bzl (a dict literal)."""
    text = open(os.path.join(ROOT, "daemon", "layers.bzl")).read()
    start = text.index("DAEMON_LAYERS = ") + len("DAEMON_LAYERS = ")
    end = text.index("\n}\n", start) + 2
    return ast.literal_eval(text[start:end])


DAEMON = daemon_layers()
for _sub, _below in DAEMON.items():
    ALLOWED["daemon/" + _sub] = ALLOWED["daemon"] | {"daemon/" + b for b in _below}
ALLOWED["daemon"] = ALLOWED["daemon"] | {"daemon/" + s for s in DAEMON}


def package_of(path):
    """The package of a repository path: its top folder, or for daemon/ the
    folder below it (daemon/ itself for the root's files)."""
    parts = path.split("/")
    if parts[0] == "daemon" and len(parts) > 2 and parts[1] in DAEMON:
        return "daemon/" + parts[1]
    return parts[0]


def allowed(pkg, tpkg):
    """May `pkg` include from `tpkg`? A package allowed "daemon" (tools/)
    may include any daemon package."""
    if tpkg in ALLOWED[pkg]:
        return True
    return tpkg.startswith("daemon/") and "daemon" in ALLOWED[pkg] and \
        not pkg.startswith("daemon")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    root = ROOT
    wrong = []
    files = 0
    for top in sorted(p for p in ALLOWED if "/" not in p):
        for base, dirs, names in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for n in sorted(names):
                if not n.endswith((".cc", ".h", ".cu", ".cuh")):
                    continue
                path = os.path.join(base, n)
                rel = os.path.relpath(path, root)
                pkg = package_of(rel)
                if pkg in FREE:
                    continue
                files += 1
                with open(path, errors="replace") as f:
                    for i, text in enumerate(f, 1):
                        m = INCLUDE.match(text)
                        if not m:
                            continue
                        target = m.group(1)
                        tpkg = package_of(target)
                        if "/" not in target or tpkg == pkg:
                            continue
                        if tpkg not in ALLOWED and tpkg not in FREE:
                            continue  # a system or generated header
                        if not allowed(pkg, tpkg):
                            wrong.append((rel, i, target, pkg, tpkg))
    for rel, i, target, pkg, tpkg in wrong:
        print("%s:%d includes %s: %s may not include %s" % (rel, i, target, pkg, tpkg))
    print("layering: %d files, %d arrows the wrong way" % (files, len(wrong)))
    return 1 if (args.check and wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
