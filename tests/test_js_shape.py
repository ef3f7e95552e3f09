"""The shape of static/js, read without a browser: no function over 80 lines, every widget runs
its jobs through lib/job.js and reconnects through ctx.connected, and no widget imports another.

The function counter is a small brace matcher: it skips strings, template literals (with their
`${...}` holes), comments and regular-expression literals, and measures every brace block that
opens a function body (`function`, a method, or an arrow `=> {`).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JS = ROOT / "static" / "js"
WIDGETS = JS / "widgets"
MAX_LINES = 80
ALL_FILES = sorted(JS.rglob("*.js"))
WIDGET_FILES = sorted(WIDGETS.glob("*.js"))

# Words before `(...) {` that make a block a statement, not a method body.
NOT_METHODS = {"if", "for", "while", "switch", "catch", "with", "return", "typeof", "await", "yield"}
# After these a `/` starts a regular expression (otherwise it divides).
REGEX_AFTER_WORDS = {"return", "typeof", "case", "do", "else", "in", "of", "new", "delete", "void", "throw",
                     "instanceof", "yield", "await"}


def code_tokens(source: str) -> list[tuple[str, int]]:
    """The source as (token, line) pairs with strings, templates, comments and regexes removed:
    each becomes one placeholder token ("S"), so the braces inside them never count. Tokens are
    words, `=>`, and single punctuation characters."""
    tokens: list[tuple[str, int]] = []
    i, line, n = 0, 1, len(source)
    stack = []   # open template literals: the brace depth inside each one's current ${ } hole

    def last() -> str:
        return tokens[-1][0] if tokens else ""

    def skip_quoted(j: int, quote: str) -> int:
        nonlocal line
        j += 1
        while j < n and source[j] != quote:
            if source[j] == "\\":
                j += 1
            elif source[j] == "\n":
                line += 1
            j += 1
        return j + 1

    def skip_template(j: int) -> int:
        """From inside a template literal's text at j: to its closing backtick (returns the index
        after it), or to a `${` (pushes a hole and returns the index after the brace)."""
        nonlocal line
        while j < n:
            c = source[j]
            if c == "\\":
                j += 2
                continue
            if c == "\n":
                line += 1
            if c == "`":
                return j + 1
            if c == "$" and j + 1 < n and source[j + 1] == "{":
                stack.append(0)
                return j + 2
            j += 1
        return j

    while i < n:
        c = source[i]
        if c == "\n":
            line += 1
            i += 1
        elif c in " \t\r":
            i += 1
        elif source.startswith("//", i):
            while i < n and source[i] != "\n":
                i += 1
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            line += source.count("\n", i, end)
            i = end
        elif c in "'\"":
            start = line
            i = skip_quoted(i, c)
            tokens.append(("S", start))
        elif c == "`":
            tokens.append(("S", line))
            i = skip_template(i + 1)
        elif c == "/" and (not tokens or last() in REGEX_AFTER_WORDS
                           or (not re.match(r"[\w$)\]]", last()) and last() != "S")):
            # a regular expression literal (a class [...] may hold a slash)
            j, in_class = i + 1, False
            while j < n and source[j] != "\n":
                if source[j] == "\\":
                    j += 2
                    continue
                if source[j] == "[":
                    in_class = True
                elif source[j] == "]":
                    in_class = False
                elif source[j] == "/" and not in_class:
                    break
                j += 1
            j += 1
            while j < n and (source[j].isalnum()):
                j += 1
            tokens.append(("S", line))
            i = j
        elif c.isalnum() or c in "_$":
            j = i
            while j < n and (source[j].isalnum() or source[j] in "_$"):
                j += 1
            tokens.append((source[i:j], line))
            i = j
        elif source.startswith("=>", i):
            tokens.append(("=>", line))
            i += 2
        elif c == "{" and stack:
            stack[-1] += 1
            tokens.append(("{", line))
            i += 1
        elif c == "}" and stack and stack[-1] == 0:
            stack.pop()                       # the end of a ${ } hole: back into the template text
            i = skip_template(i + 1)
        elif c == "}" and stack:
            stack[-1] -= 1
            tokens.append(("}", line))
            i += 1
        else:
            tokens.append((c, line))
            i += 1
    return tokens


def opens_function(tokens: list[tuple[str, int]], k: int) -> str | None:
    """If the `{` at tokens[k] opens a function body, the function's name (or a description)."""
    prev = tokens[k - 1][0] if k else ""
    if prev == "=>":
        j = k - 2
        name = "arrow"
        # `const name = (...) =>` or `name = x =>`: find the name for the message
        depth = 0
        while j >= 0:
            t = tokens[j][0]
            if t == ")":
                depth += 1
            elif t == "(":
                depth -= 1
                if depth < 0:
                    break
            elif depth == 0 and t in ("=", ":") and j > 0:
                name = tokens[j - 1][0]
                break
            elif depth == 0 and t in (";", "{", "}", ","):
                break
            j -= 1
        return name
    if prev != ")":
        return None
    depth, j = 0, k - 1
    while j >= 0:                           # back to the `(` that matches
        t = tokens[j][0]
        if t == ")":
            depth += 1
        elif t == "(":
            depth -= 1
            if depth == 0:
                break
        j -= 1
    before = tokens[j - 1][0] if j > 0 else ""
    if before == "function":
        return "function"
    if j > 1 and tokens[j - 2][0] == "function":
        return before
    if re.fullmatch(r"[A-Za-z_$][\w$]*", before) and before not in NOT_METHODS:
        return before                        # a method: name(...) {
    return None


def functions(source: str) -> list[tuple[str, int, int]]:
    """Every function body in the source: (name, first line, last line)."""
    tokens = code_tokens(source)
    found, opened = [], []                    # opened: (is_function, name, line) per open brace
    for k, (tok, line) in enumerate(tokens):
        if tok == "{":
            name = opens_function(tokens, k)
            opened.append((name, line))
        elif tok == "}" and opened:
            name, start = opened.pop()
            if name is not None:
                found.append((name, start, line))
    return found


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- the counter itself ------------------------------------------------------------------------

def test_the_counter_skips_strings_templates_comments_and_regexes():
    source = "\n".join([
        "function a(x) {",                       # 1
        "  const s = '}}}';  // }}",             # 2
        "  const t = `${x ? `{${'}'}` : '{'}}`;",  # 3
        "  /* } */ const r = /[}/]+/g;",           # 4
        "  const f = (y) => { return y / 2 / 1; };",  # 5
        "  return s + t + r + f;",               # 6
        "}",                                     # 7
        "class C {",                             # 8
        "  method(z) {",                         # 9
        "    if (z) { return 1; }",              # 10
        "  }",                                   # 11
        "}",                                     # 12
    ])
    assert functions(source) == [("f", 5, 5), ("a", 1, 7), ("method", 9, 11)]


# ---- every file ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ALL_FILES, ids=rel)
def test_no_function_over_80_lines(path):
    long = [f"{name} at line {start} ({end - start + 1} lines)" for name, start, end in functions(path.read_text())
            if end - start + 1 > MAX_LINES]
    assert not long, f"{rel(path)}: functions over {MAX_LINES} lines: {long}"


def imports(path: Path) -> list[str]:
    return re.findall(r"""^\s*import\s[^;]*?from\s+["']([^"']+)["']""", path.read_text(), re.M | re.S)


@pytest.mark.parametrize("path", WIDGET_FILES, ids=rel)
def test_widget_runs_jobs_through_lib_job(path):
    assert "../lib/job.js" in imports(path), f"{rel(path)} does not import lib/job.js"


@pytest.mark.parametrize("path", WIDGET_FILES, ids=rel)
def test_widget_reconnects_through_ctx_connected(path):
    source = path.read_text()
    helpers = [spec for spec in imports(path) if spec.startswith("../lib/")
               and "ctx.connected" in (WIDGETS / spec).resolve().read_text()]
    assert "ctx.connected" in source or helpers, f"{rel(path)} never calls ctx.connected"
    assert "onStatus" not in source, f"{rel(path)} listens to the client's status itself: use ctx.connected"


@pytest.mark.parametrize("path", WIDGET_FILES, ids=rel)
def test_widget_imports_no_other_widget(path):
    specs = imports(path) + re.findall(r"""import\(\s*["'`]([^"'`]+)""", path.read_text())
    others = [spec for spec in specs if (WIDGETS / spec).resolve().parent == WIDGETS or "${" in spec]
    assert not others, f"{rel(path)} imports {others}: widgets share code through ../lib/ only"
