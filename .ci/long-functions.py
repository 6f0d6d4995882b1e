#!/usr/bin/env python3
"""List functions/methods over LIMIT lines in src/**/*.rs and python/safeload/*.py.

Length = signature line .. closing line, inclusive. Doc comments above a Rust fn
(`///`) and Python decorators are outside that span; Python docstrings inside the
body are subtracted. Rust items inside `#[cfg(test)]` modules are skipped.
Usage: python .ci/long-functions.py [ROOT] [LIMIT] [--with-docstrings] (issue 53: none over 80)
"""
import ast
import pathlib
import re
import sys

WITH_DOCSTRINGS = "--with-docstrings" in sys.argv
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ROOT = pathlib.Path(ARGS[0] if ARGS else ".")
LIMIT = int(ARGS[1]) if len(ARGS) > 1 else 80

FN_RE = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:default\s+)?(?:const\s+)?(?:async\s+)?"
    r"(?:unsafe\s+)?(?:extern\s+(?:\"[^\"]*\"\s+)?)?fn\s+([A-Za-z_][A-Za-z0-9_]*)"
)
MOD_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


def mask_rust(text: str) -> str:
    """Blank out comments, strings and char literals (keeping newlines) so braces can be counted."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth += 1
                    j += 2
                elif text.startswith("*/", j):
                    depth -= 1
                    j += 2
                else:
                    j += 1
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif (m := re.match(r'b?r(#*)"', text[i:i + 300])) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = '"' + m.group(1)
            j = text.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:  # lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def rust_functions(path: pathlib.Path):
    text = path.read_text()
    masked = mask_rust(text)
    lines = masked.split("\n")
    # line index -> brace depth at line start, and close line for each opening brace
    offset_line = []
    line = 0
    for ch in masked:
        offset_line.append(line)
        if ch == "\n":
            line += 1
    # match braces
    match = {}
    stack = []
    for pos, ch in enumerate(masked):
        if ch == "{":
            stack.append(pos)
        elif ch == "}" and stack:
            match[stack.pop()] = pos
    line_offsets = [0]
    for ln in lines:
        line_offsets.append(line_offsets[-1] + len(ln) + 1)

    def body_span(start_line):
        """From a line, the first `{` (or `;` for a bodiless fn) -> (open_pos, close_line)."""
        pos = line_offsets[start_line]
        depth_paren = 0
        while pos < len(masked):
            ch = masked[pos]
            if ch in "([<" and ch != "<":
                depth_paren += 1
            elif ch in ")]":
                depth_paren -= 1
            elif ch == ";" and depth_paren == 0:
                return None
            elif ch == "{" and depth_paren == 0:
                return pos, offset_line[match.get(pos, pos)]
            pos += 1
        return None

    # test modules to skip
    skip = []
    for i, ln in enumerate(lines):
        if "#[cfg(test)]" in ln:
            for k in range(i + 1, min(i + 4, len(lines))):
                if MOD_RE.match(lines[k]):
                    span = body_span(k)
                    if span:
                        skip.append((k, span[1]))
                    break
    results = []
    for i, ln in enumerate(lines):
        m = FN_RE.match(ln)
        if not m or any(a <= i <= b for a, b in skip):
            continue
        span = body_span(i)
        if span is None:
            continue
        length = span[1] - i + 1
        results.append((length, f"{path}:{i + 1}", m.group(1)))
    return results


def python_functions(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    results = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = child.end_lineno - child.lineno + 1
                body = child.body
                if not WITH_DOCSTRINGS and body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
                    length -= body[0].end_lineno - body[0].lineno + 1
                name = f"{prefix}{child.name}"
                results.append((length, f"{path}:{child.lineno}", name))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return results


def main():
    found = []
    for p in sorted((ROOT / "src").rglob("*.rs")):
        found += rust_functions(p.relative_to(ROOT) if False else p)
    for p in sorted((ROOT / "python" / "safeload").glob("*.py")):
        found += python_functions(p)
    long = sorted((f for f in found if f[0] > LIMIT), key=lambda f: -f[0])
    for length, where, name in long:
        print(f"{length:4d}  {name:32s} {pathlib.Path(where).as_posix().replace(str(ROOT) + '/', '')}")
    print(f"{len(long)} function(s) over {LIMIT} lines ({len(found)} scanned)")


if __name__ == "__main__":
    main()
