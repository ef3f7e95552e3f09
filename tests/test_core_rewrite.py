"""tools/core_rewrite.py: old flat core imports become the packages' paths, and a second run changes nothing."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("core_rewrite", ROOT / "tools" / "core_rewrite.py")
core_rewrite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core_rewrite)

OLD = '''from core import expert_parallel, probes
from core.gemm import PackedLinear
from core.model import Transformer
from core.lab.load import poisson_arrivals


def work(engine):
    from core import native
    native.extension()
    stats = engine.kv_stats()
    return engine.tokenizer, engine.trace, stats  # core/engine.py, core/csrc/decoder.cpp
'''
NEW = '''from app.lab.load import poisson_arrivals
from core.inspect import probes
from core.model.linear import PackedLinear
from core.model.model import Transformer
from core.parallel import expert_parallel


def work(engine):
    from core.kernels import loader
    loader.extension()
    stats = engine.view.kv_stats()
    return engine.view.tokenizer, engine.view.trace, stats  # core/engine/llm_engine.py, core/kernels/csrc/decoder.cpp
'''


def test_old_paths_become_new_and_a_second_run_changes_nothing():
    path = Path("app/widgets/example.py")
    once = core_rewrite.rewrite_text(OLD, path)
    assert once == NEW
    assert core_rewrite.rewrite_text(once, path) == once


def test_new_paths_that_reuse_an_old_name_are_left_alone():
    text = "from core.model import attention\nfrom core.engine.llm_engine import LLMEngine\nimport core.model.model\n"
    assert core_rewrite.rewrite_text(text, Path("tests/test_x.py")) == text


def test_the_tree_is_rewritten_already():
    for path in core_rewrite.files([], ROOT):
        text = (ROOT / path).read_text()
        assert core_rewrite.rewrite_text(text, path) == text, path
