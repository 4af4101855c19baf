#!/usr/bin/env python3
"""Reports what is too long to read in one sitting: source files over a
line limit and functions over a length limit (the structure issue's
thresholds: a .cc over 500 lines, a header over 300, a function over 120).

    tools/code_size.py [--check] [DIR ...]        # default: daemon

Prints every file and function over its limit, longest first, and the
ten longest functions anyway. With --check, exits 1 when anything is
over a limit (for the test command once the code meets them).

Functions are found without a C++ parser: a brace block whose opening text
(since the previous ';', '{' or '}') has a parameter list and that sits
directly in a namespace or a class is a function body; its length is the
lines from its signature to its closing brace. Lambdas and control blocks
inside a function count toward that function.
"""

import argparse
import os
import re
import sys

CC_LIMIT, HEADER_LIMIT, FUNCTION_LIMIT = 500, 300, 120


def strip_code(text):
    """The text with comments, strings and character literals blanked (line
    breaks kept), so braces in them do not count."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                end = n if end < 0 else end + len(m.group(1)) + 2
                out.append("\n" * text.count("\n", i, end))
                i = end
            else:
                out.append(c)
                i += 1
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(path):
    """(name, first line, lines) of every function body in the file."""
    with open(path, errors="replace") as f:
        code = strip_code(f.read())
    found = []
    stack = []  # (kind, start line, name)
    opener = []  # text since the last ; { }
    line = 1
    opener_line = 1
    for c in code:
        if c == "\n":
            line += 1
        if c == "{":
            text = "".join(opener)
            head = " ".join(text.split())
            inside_function = any(k == "function" for k, _, _ in stack)
            if inside_function:
                kind = "block"
            elif re.search(r"\b(namespace|extern \"C\")\b", head) or head.endswith("extern"):
                kind = "namespace"
            elif re.match(r"^(template\s*<.*>\s*)?(class|struct|union|enum)\b", head) \
                    and "(" not in head.split(":")[0]:
                kind = "class"
            elif "(" in head and not re.search(r"=\s*$", head):
                kind = "function"
            else:
                kind = "block"
            name = ""
            if kind == "function":
                m = re.search(r"([~\w:<>]+)\s*\(", head)
                name = m.group(1) if m else head[:40]
            stack.append((kind, opener_line, name))
            opener = []
            opener_line = line
        elif c == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "function" and not any(k == "function" for k, _, _ in stack):
                    found.append((name, start, line - start + 1))
            opener = []
            opener_line = line
        elif c == ";":
            opener = []
            opener_line = line
        else:
            if not opener and c.isspace():
                opener_line = line + (1 if c == "\n" else 0)
                continue
            if not opener:
                opener_line = line
            opener.append(c)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="*", default=["daemon"])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    over_files, funcs = [], []
    for d in args.dirs:
        for base, _, names in os.walk(os.path.join(root, d)):
            for n in sorted(names):
                if not n.endswith((".cc", ".h")):
                    continue
                path = os.path.join(base, n)
                rel = os.path.relpath(path, root)
                with open(path, errors="replace") as f:
                    count = sum(1 for _ in f)
                limit = CC_LIMIT if n.endswith(".cc") else HEADER_LIMIT
                if count > limit:
                    over_files.append((count, limit, rel))
                for name, start, length in functions(path):
                    funcs.append((length, rel, start, name))
    over_files.sort(reverse=True)
    funcs.sort(reverse=True)
    over_funcs = [f for f in funcs if f[0] > FUNCTION_LIMIT]
    print("files over their limit (.cc %d, .h %d lines): %d"
          % (CC_LIMIT, HEADER_LIMIT, len(over_files)))
    for count, limit, rel in over_files:
        print("  %5d  %s (limit %d)" % (count, rel, limit))
    print("functions over %d lines: %d" % (FUNCTION_LIMIT, len(over_funcs)))
    for length, rel, start, name in over_funcs:
        print("  %5d  %s:%d %s" % (length, rel, start, name))
    print("the ten longest functions:")
    for length, rel, start, name in funcs[:10]:
        print("  %5d  %s:%d %s" % (length, rel, start, name))
    if args.check and (over_files or over_funcs):
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader (head, sed) had enough
        sys.exit(0)
