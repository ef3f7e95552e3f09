"""Which pytest-xdist process runs which tests (`make test`: `-n 2 --dist loadgroup`).

A group's tests run in one process, one after another: a test module is one group, so the
module's own server or engine starts once; every test of the real-model server (conftest's
`server`: `python -m app`, whose first jobs take minutes) is one group, so one server computes
them once; the tests that load transformers' reference are one group too (conftest: XDIST_GROUPS).

xdist's own `loadgroup` reads `@pytest.mark.xdist_group` into a suffix of the test's id, which
pytest 9.2's ids no longer take, so here the groups travel another way: each worker process
writes {test id: group} to a file once it has collected (the same file from each: the same
collection), and this scheduler, LoadScopeScheduling with a group as its scope, reads it when it
first schedules, after every worker has collected.
"""

import json
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

WORKER_KEY = "sendlens_groups_file"      # in each worker's workerinput: where to write its groups


# Groups that start before all others. xdist queues groups by their number of tests, largest
# first, so a module of two tests of minutes each came last and ran alone at the end: the AVX2-only
# CPU's module (about 7 minutes under qemu) took `make test` from 11 to 18 minutes that way.
FIRST = {"tests/test_emulated_cpu.py"}


class FirstInLine(OrderedDict):
    """xdist's queue of groups (its workqueue), with the groups of FIRST moved to its front as they
    are queued."""

    def __setitem__(self, group, tests):
        super().__setitem__(group, tests)
        if group in FIRST:
            self.move_to_end(group, last=False)


class GroupScheduling(LoadScopeScheduling):
    """xdist's scheduling by scope, with a test's group (read from `path`) as its scope, and the
    groups of FIRST first."""

    def __init__(self, config, log, path: Path):
        super().__init__(config, log)
        self.path, self.groups = path, None
        self.workqueue = FirstInLine()

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:
            self.groups = json.loads(self.path.read_text())
        return self.groups.get(nodeid) or nodeid.rsplit("::", 1)[0]


class Controller:
    """The plugin of the controlling process: a groups file for the workers, and the scheduler."""

    def __init__(self):
        self.path = Path(tempfile.mkdtemp(prefix="sendlens-xdist-")) / "groups.json"

    def pytest_configure_node(self, node) -> None:
        node.workerinput[WORKER_KEY] = str(self.path)

    def pytest_xdist_make_scheduler(self, config, log):
        return GroupScheduling(config, log, self.path) if config.getvalue("dist") == "loadgroup" else None

    def pytest_unconfigure(self, config) -> None:
        shutil.rmtree(self.path.parent, ignore_errors=True)   # with a worker's half-written file, if one died


def configure(config) -> None:
    """From conftest's pytest_configure: in the controller of an xdist run, register Controller."""
    if config.pluginmanager.hasplugin("dsession"):
        config.pluginmanager.register(Controller(), "sendlens-xdist-groups")


def write_groups(config, items, group_of) -> None:
    """In an xdist worker, after collection: write {test id: group_of(item)} where the controller
    said (atomically: both workers write the same file)."""
    path = getattr(config, "workerinput", {}).get(WORKER_KEY)
    if path is None:
        return
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    os.replace(tmp, path)
