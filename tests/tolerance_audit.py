"""Issue 23's check that every float tolerance in tests/ says how it is derived: lists each float
comparison (approx(, allclose(, isclose(, atol=/rtol=, or a 1e-N literal beside a comparison or a
+/- on an assert) that has neither a comment on its line or in the 6 lines above, nor a tolerance
named after a bound whose definition derives it (tests/bounds.py's, or a constant or function of
the test file: F64, SHOWN, PROB_TOL, *_bound, *_tolerance), and prints the counts. A heuristic for
a reader, not a test: a comment nearby still has to be the derivation.
Run from the repository root: python tests/tolerance_audit.py"""
import re, sys, pathlib
CMP = re.compile(r"approx\(|allclose\(|isclose\(|atol=|rtol=|(==|<=|>=|<|>)\s*-?\d(\.\d+)?e-\d+|[-+]\s*\d(\.\d+)?e-\d+")
NAMED = re.compile(r"(rel|abs|atol|rtol)=\s*[^,)]*\b(F64|SHOWN|PROB_TOL|\w+_bound|\w+_tolerance)\b|<=\s*[^,]*\w+_bound\(")
total = commented = named = 0
for p in sorted(pathlib.Path("tests").rglob("*.py")):
    if p.name in ("bounds.py", "tolerance_audit.py"):
        continue
    lines = p.read_text().splitlines()
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if not CMP.search(code) or ("assert" not in code and not re.search(r"approx\(|allclose\(|isclose\(", code)):
            continue                      # a constant such as eps=1e-5 or temperature=1e-45, not a comparison
        if code.count("(") > code.count(")") and i + 1 < len(lines):
            code += lines[i + 1].split("#", 1)[0]         # the tolerance on the continuation line
        total += 1
        if any("#" in l for l in lines[max(0, i - 6): i + 1]):
            commented += 1
        elif NAMED.search(code):
            named += 1
        else:
            print(f"NO DERIVATION {p}:{i + 1}: {line.strip()}")
print(f"{total} float comparisons: {commented} with a comment on or within 6 lines above, {named} with a "
      f"named derived bound, {total - commented - named} with neither", file=sys.stderr)
