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
inside a function count toward that function. Braces that initialize
rather than open a body belong to the opening text: those inside
parentheses (a default argument `= {}`, `int{3}`) and a constructor's
member initializers (`: a_(x), b_{y} {`).

    tools/code_size.py --self-test               # the finder on known cases
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
    parens = 0  # '(' less ')' in opener
    line = 1
    opener_line = 1
    for c in code:
        if c == "\n":
            line += 1
        in_init = bool(stack) and stack[-1][0] == "init"
        if c == "{":
            text = "".join(opener)
            head = " ".join(text.split())
            inside_function = any(k == "function" for k, _, _ in stack)
            is_class = re.match(r"^(template\s*<.*>\s*)?(class|struct|union|enum)\b", head) \
                and "(" not in head.split(":")[0]
            if not inside_function and (in_init or parens > 0 or (
                    MEMBER_INIT.search(head) and not is_class)):
                # An initializer in the opening text, not a body: the text
                # goes on past it.
                stack.append(("init", line, ""))
                opener.append(c)
                continue
            if inside_function:
                kind = "block"
            elif re.search(r"\b(namespace|extern \"C\")\b", head) or head.endswith("extern"):
                kind = "namespace"
            elif is_class:
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
            if in_init:
                stack.pop()
                opener.append(c)
                continue
            if stack:
                kind, start, name = stack.pop()
                if kind == "function" and not any(k == "function" for k, _, _ in stack):
                    found.append((name, start, line - start + 1))
            opener = []
            parens = 0
            opener_line = line
        elif c == ";" and not in_init:
            opener = []
            parens = 0
            opener_line = line
        else:
            if not opener and c.isspace():
                opener_line = line + (1 if c == "\n" else 0)
                continue
            if not opener:
                opener_line = line
            opener.append(c)
            if c == "(":
                parens += 1
            elif c == ")":
                parens -= 1
    return found


# A constructor's opening text up to a member initialized with braces:
# a parameter list, then one ':' (not '::'), ending in the member's name
# or a base's template arguments (`Foo::Foo(int x) : a_(x), b_{`).
MEMBER_INIT = re.compile(r"\)[^()]*?(?<!:):(?!:).*[\w>]$")

# (source, [(name, first line, lines)]) the finder must get right.
SELF_TEST = [
    ("void F(int a) {\n  g(a);\n}\n", [("F", 1, 3)]),
    ("Foo::Foo(int x) : a_(x), b_{x} {\n  y();\n}\n", [("Foo::Foo", 1, 3)]),
    ("Bar::Bar(int x)\n    : a_{x},\n      b_(x) {\n  y();\n}\n",
     [("Bar::Bar", 1, 5)]),
    ("void D(Options o = {}) {\n  y();\n}\n", [("D", 1, 3)]),
    ("class C {\n void M(int a = int{3}) { y(); }\n int x_{0};\n"
     " C() : x_{1} {}\n};\n", [("M", 2, 1), ("C", 4, 1)]),
    ("namespace n {\nstruct S : Base<T> {\n  void M() {\n  }\n};\n}\n",
     [("M", 3, 2)]),
    ("struct S final : Base {\n  S() : a_{1} {}\n  void M() {\n  }\n};\n",
     [("S", 2, 1), ("M", 3, 2)]),
    ("auto F() -> ns::T {\n  return {};\n}\n", [("F", 1, 3)]),
    ("void K() const {\n  if (a) {\n    b = c ? d : e{};\n  }\n}\n",
     [("K", 1, 5)]),
    ("const std::map<int, int> kM = {{1, 2}};\nvoid G() {\n}\n",
     [("G", 2, 2)]),
]


def self_test():
    import tempfile
    failures = 0
    for source, want in SELF_TEST:
        with tempfile.NamedTemporaryFile("w", suffix=".cc") as f:
            f.write(source)
            f.flush()
            got = functions(f.name)
        if got != want:
            failures += 1
            print("code_size self-test: %r\n  want %r\n  got  %r"
                  % (source, want, got))
    print("code_size self-test: %d cases, %d failed"
          % (len(SELF_TEST), failures))
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="*", default=["daemon"])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
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
