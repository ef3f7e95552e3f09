"""The test run's own scheduling (tests/xdist_groups.py): the long groups start first."""

from pathlib import Path

from xdist_groups import FIRST, FirstInLine

ROOT = Path(__file__).resolve().parents[1]


def test_the_first_groups_leave_the_queue_first_in_any_order_of_arrival():
    queue = FirstInLine()
    for group in ["tests/a.py", *sorted(FIRST), "real-server", "tests/b.py"]:
        queue[group] = {f"{group}::t": False}
    taken = [queue.popitem(last=False)[0] for _ in range(len(queue))]
    assert set(taken[:len(FIRST)]) == FIRST
    assert taken[len(FIRST):] == ["tests/a.py", "real-server", "tests/b.py"]   # the rest keep their order
    queue.update({"tests/c.py": {}, next(iter(FIRST)): {}})   # a lost worker's groups, queued again
    assert next(iter(queue)) == next(iter(FIRST))


def test_each_first_group_is_a_test_module_here():
    """A renamed module would silently go back to the end of the queue."""
    for group in FIRST:
        assert (ROOT / group).is_file(), group
