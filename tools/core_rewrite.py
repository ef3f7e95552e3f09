"""Rewrite imports of core's old flat modules to the packages they moved into (issue 24).

    python tools/core_rewrite.py                 # every .py, .md and .js file (and Makefile, pyproject)
    python tools/core_rewrite.py app/x.py a.md   # only these files
    python tools/core_rewrite.py --imports-only  # module paths only, not the engine's view

What it rewrites, in place:
- `from core.X import ...`, `import core.X`, `core.X.attr`, `-m core.X`: the old module path to the
  new one (core.gemm -> core.model.linear, core.engine -> core.engine.llm_engine, ...);
- `from core import probes, workers`: one line per new package (`from core.inspect import probes`);
- file paths in prose: `core/gemm.py` -> `core/model/linear.py`, `core/csrc/` -> `core/kernels/csrc/`;
- reads of an engine's state that moved to its read-only view: `engine.stats()` ->
  `engine.view.stats()`, `engine.trace` -> `engine.view.trace` everywhere, and under app/ and
  bench/ (which read the engine only through the view) `engine.tokenizer`, `exp.model_config`,
  ... -> `engine.view.tokenizer`, ... (for names that are engines by convention: engine, exp,
  sib, sibling, cold, warm, and self./runtime./llm. engine)

Idempotent: a path that already names a new module is left as it is, so it can be run again on a
branch that was merged after the move (its old imports are rewritten, the rest stays).
"""

import re
import sys
from pathlib import Path

# Old module -> new module. A name in core/ that is not here did not move.
MODULES = {
    "core.engine": "core.engine.llm_engine",
    "core.engine_loop": "core.engine.engine_loop",
    "core.scheduler": "core.engine.scheduler",
    "core.block_manager": "core.engine.block_manager",
    "core.sequence": "core.engine.sequence",
    "core.sampling_params": "core.engine.sampling_params",
    "core.outputs": "core.engine.outputs",
    "core.trace": "core.engine.trace",
    "core.model": "core.model.model",
    "core.attention": "core.model.attention",
    "core.moe": "core.model.moe",
    "core.gemm": "core.model.linear",
    "core.kv_cache": "core.model.kv_cache",
    "core.tokenizer": "core.model.tokenizer",
    "core.detokenizer": "core.model.detokenizer",
    "core.model_runner": "core.model.model_runner",
    "core.sampler": "core.model.sampler",
    "core.native": "core.model.native_decoder",   # the loader itself is core.kernels.loader
    "core.workers": "core.parallel.workers",
    "core.tensor_parallel": "core.parallel.tensor_parallel",
    "core.pipeline": "core.parallel.pipeline",
    "core.expert_parallel": "core.parallel.expert_parallel",
    "core.probes": "core.inspect.probes",
    "core.models": "core.registry",
    "core.lab.economics": "app.lab.economics",
    "core.lab.load": "app.lab.load",
    "core.lab": "app.lab",
}
# Names that moved out of core.native into the kernels' loader.
LOADER_NAMES = {"extension", "kernels", "SOURCES"}
# Old names that are new packages too: `from core.model import attention` is already new.
NEW_PACKAGES = {
    "core.engine": {"llm_engine", "engine_loop", "scheduler", "block_manager", "sequence", "sampling_params",
                    "outputs", "trace", "step_recorder", "view"},
    "core.model": {"model", "attention", "moe", "linear", "kv_cache", "tokenizer", "detokenizer",
                   "model_runner", "sampler", "native_decoder"},
}
NEW_MODULES = set(MODULES.values()) | {"core.kernels.loader", "core.engine.step_recorder", "core.engine.view"} \
    | {f"{pkg}.{sub}" for pkg, subs in NEW_PACKAGES.items() for sub in subs}
PATHS = {old.replace(".", "/") + ".py": new.replace(".", "/") + ".py" for old, new in MODULES.items()}
PATHS.update({"core/csrc/": "core/kernels/csrc/", "core/lab/": "app/lab/"})
PATHS.update({old.replace(".", "/") + ".": new.replace(".", "/") + "."        # core/tensor_parallel.split_error
              for old, new in MODULES.items() if old.count(".") == 1})

# Engine reads that moved to LLMEngine.view: methods and the attributes the engine no longer has
# (everywhere), and the engine's settings, which the app's side reads through the view too.
VIEW_METHODS = ("info", "stats", "kv_stats", "block_tables", "kv_pool_map")
MOVED_ATTRS = ("reference_model", "model", "cache", "trace", "num_steps", "start_time")
APP_ATTRS = ("config", "model_config", "tokenizer", "max_model_len")
OWNERS = r"(?:self|loop|llm|self\.loop|(?:\w+\.)*runtime)"
ENGINE = r"(?<![\w.])((?:" + OWNERS + r"\.)?engine|exp|sib|sibling|cold|warm)"
# tests/ name their engines more freely, and build them with make_*engine(...)
TEST_ENGINE = r"(?<![\w.])((?:(?:" + OWNERS + r")\.)?engine|exp|sib|sibling|cold|warm|same|other|plain|fixed" \
    r"|make_\w*engine\([^()\n]*\))"
METHOD_RE = re.compile(ENGINE + r"\.(" + "|".join(VIEW_METHODS) + r")\(")
MOVED_RE = re.compile(ENGINE + r"\.(" + "|".join(MOVED_ATTRS) + r")\b(?!\s*=[^=])")
TEST_METHOD_RE = re.compile(TEST_ENGINE + r"\.(" + "|".join(VIEW_METHODS) + r")\(")
TEST_MOVED_RE = re.compile(TEST_ENGINE + r"\.(" + "|".join(MOVED_ATTRS) + r")\b(?!\s*=[^=])")
CPU_SHARE_RE = re.compile(TEST_ENGINE + r"\.cpu_share\b")     # the runner sets the threads now
ATTR_RE = re.compile(ENGINE + r"\.(" + "|".join(APP_ATTRS) + r")\b(?!\s*=[^=])")

# A dotted path to rewrite; a from-import's module is not one (rewrite_from has done it).
DOTTED = re.compile(r"(?<![\w./])core(?:\.[A-Za-z_]\w*)+(?![\w.]|[ \t]+import\b)")
FROM_IMPORT = re.compile(r"^([ \t]*)from[ \t]+(core(?:\.\w+)*)[ \t]+import[ \t]+(\(?)([^#\n]*?)(\)?)([ \t]*#.*)?$", re.M)
IMPORT_LINE = re.compile(r"^[ \t]*from[ \t]+(?:core|app)[\w.]*[ \t]+import[ \t]+[^(\n]*$")


def is_module(package: str, name: str) -> bool:
    """Is core's package.name a module of the tree as it is now (one added after the move)?"""
    path = Path(__file__).resolve().parent.parent.joinpath(*package.split("."), name)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def new_module(dotted: str, names: list[str] | None = None) -> str:
    """A module path (maybe with attributes after it) with its old module part mapped to the new."""
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        head, rest = ".".join(parts[:i]), parts[i:]
        if head in NEW_MODULES and head not in MODULES:
            return dotted
        if head in NEW_PACKAGES and rest and (rest[0] in NEW_PACKAGES[head] or is_module(head, rest[0])):
            return dotted                                   # core.model.attention: already new
        if head in NEW_PACKAGES and names and all(n in NEW_PACKAGES[head] for n in names):
            return dotted                                   # from core.model import attention
        if head in MODULES:
            new = MODULES[head]
            if head == "core.native" and (names and set(names) <= LOADER_NAMES or rest and rest[0] in LOADER_NAMES):
                new = "core.kernels.loader"
            return ".".join([new, *rest])
    return dotted


def split_names(text: str) -> list[str]:
    return [n.strip() for n in text.replace("\n", " ").split(",") if n.strip()]


def rewrite_from(match: re.Match) -> str:
    indent, module, lparen, names_text, rparen, comment = match.groups()
    names = split_names(names_text)
    bare = [n.split(" as ")[0].strip() for n in names]
    comment = comment or ""
    if module == "core":                         # from core import probes, workers, LLM
        groups: dict[str, list[str]] = {}
        for name, b in zip(names, bare):
            target = MODULES.get(f"core.{b}")
            if b == "native" and name == b:          # split in two: the loader and the decoder's wrapper
                groups.setdefault("core.kernels", []).append("loader")
                groups.setdefault("core.model", []).append("native_decoder")
                continue
            if target:                               # a module that moved (maybe renamed)
                parent, leaf = target.rsplit(".", 1)
                alias = name.split(" as ")[1].strip() if " as " in name else b
                name = leaf if leaf == alias else f"{leaf} as {alias}"
            else:
                parent = "core"
            groups.setdefault(parent, []).append(name)
        out = "\n".join(f"{indent}from {pkg} import {', '.join(ns)}" + (comment if i == 0 else "")
                        for i, (pkg, ns) in enumerate(groups.items()))
        return match.group(0) if out == f"{indent}from core import {', '.join(names)}{comment}" else out
    new = new_module(module, bare)
    if new == module:
        return match.group(0)
    return f"{indent}from {new} import {lparen}{names_text}{rparen}{comment}"


def sort_imports(text: str) -> str:
    """Each run of one-line `from core...`/`from app...` imports in module order (as isort would)."""
    lines, out, run = text.split("\n"), [], []
    for line in lines + [None]:
        if line is not None and IMPORT_LINE.match(line):
            run.append(line)
            continue
        out.extend(sorted(run, key=lambda l: l.split()[1]))
        run = []
        if line is not None:
            out.append(line)
    return "\n".join(out)


def split_native(text: str) -> str:
    """After `from core import native` became two imports: `native.extension` -> `loader.extension`,
    `native.NativeDecoder` -> `native_decoder.NativeDecoder`, and the import a file does not use goes."""
    text = re.sub(r"(?<![\w.])native\.(" + "|".join(LOADER_NAMES) + r")\b", r"loader.\1", text)
    text = re.sub(r"(?<![\w.])native\.(?!py\b)(\w+)", r"native_decoder.\1", text)
    for pkg, mod in (("core.kernels", "loader"), ("core.model", "native_decoder")):
        if f"{mod}." not in text:
            text = re.sub(rf"^([ \t]*)from {pkg} import {mod}\n", "", text, flags=re.M)
    return text


def rewrite_text(text: str, path: Path, view: bool = True) -> str:
    text = text.replace('logger="core.native"', 'logger="core.kernels.loader"')   # the loader logs its build
    native = re.search(r"^[ \t]*from[ \t]+core[ \t]+import[ \t]+.*\bnative\b(?![ \t]+as)", text, re.M)
    new = FROM_IMPORT.sub(rewrite_from, text)
    if new != text:
        text = sort_imports(split_native(new) if native else new)
    text = DOTTED.sub(lambda m: new_module(m.group(0)), text)
    for old, new in PATHS.items():
        text = re.sub(r"(?<![\w/])" + re.escape(old), new, text)
    if not view:
        return text
    tests = bool(path.parts) and path.parts[0] == "tests"
    text = (TEST_METHOD_RE if tests else METHOD_RE).sub(r"\1.view.\2(", text)
    text = (TEST_MOVED_RE if tests else MOVED_RE).sub(r"\1.view.\2", text)
    if tests:
        text = CPU_SHARE_RE.sub(r"\1.runner.cpu_share", text)
    if path.parts and path.parts[0] in ("app", "bench"):
        text = ATTR_RE.sub(r"\1.view.\2", text)
    return text


def files(args: list[str], root: Path) -> list[Path]:
    if args:
        return [Path(a) for a in args]
    skip = {".git", ".venv", "node_modules", "artifacts", "__pycache__"}
    found = [p for ext in ("*.py", "*.md", "*.js") for p in root.rglob(ext) if not skip & set(p.parts)]
    found += [root / "Makefile", root / "pyproject.toml"]
    return [p.relative_to(root) if p.is_absolute() else p for p in found
            if p.exists() and p.name not in ("core_rewrite.py", "test_core_rewrite.py")]   # its examples stay old


def main(argv: list[str]) -> int:
    root = Path.cwd()
    view = "--imports-only" not in argv
    argv = [a for a in argv if a != "--imports-only"]
    changed = 0
    for path in files(argv, root):
        text = path.read_text()
        new = rewrite_text(text, path, view)
        if new != text:
            path.write_text(new)
            changed += 1
            print(path)
    print(f"{changed} file(s) rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
