"""BlockManager on its own: paged allocation, reference counts, and the prefix cache (no model)."""

import pytest

import core.engine.block_manager as bm_module
from core.engine.block_manager import BlockManager, hash_block
from core.errors import InvalidParameter

BS = 4  # a small block size keeps the token lists short


class FakeSeq:
    """The fields of core.engine.sequence.Sequence that the block manager reads and writes."""

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0

    @property
    def num_tokens(self):
        return len(self.token_ids)


def run_prefill(bm: BlockManager, seq: FakeSeq) -> None:
    """Admit seq (reusing its cached prefix), 'compute' every token, publish its full blocks."""
    ids, hashes = bm.find_cached_prefix(seq)
    n = seq.num_tokens - len(ids) * bm.block_size
    assert bm.can_admit(seq, ids, n)
    bm.admit(seq, ids, hashes, n)
    seq.num_computed_tokens = seq.num_tokens
    bm.publish(seq)


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert set(bm.ref_counts()) == {0}


def test_needs_at_least_one_block():
    with pytest.raises(InvalidParameter) as exc:
        BlockManager(0, BS)
    assert exc.value.param == "num_kv_blocks"


def test_blocks_needed_rounds_up():
    bm = BlockManager(8, BS)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocation_on_demand():
    bm = BlockManager(8, BS)
    seq = FakeSeq(range(100, 101))
    bm.allocate(seq, 1)                       # one token: one block, nothing reserved ahead
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 7
    for n in range(2, BS + 1):                # decode tokens fill the same block
        seq.num_computed_tokens = n - 1
        seq.token_ids.append(100 + n)
        bm.allocate(seq, 1)
        assert len(seq.block_table) == 1
    seq.num_computed_tokens = BS              # the next token starts a new block
    seq.token_ids.append(999)
    assert bm.can_allocate(seq, 1)
    bm.allocate(seq, 1)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert len(set(seq.block_table)) == 2
    assert [bm.ref_counts()[b] for b in seq.block_table] == [1, 1]


def test_allocate_without_room_is_refused():
    bm = BlockManager(2, BS)
    seq = FakeSeq(range(3 * BS))
    assert not bm.can_allocate(seq, 3 * BS)
    assert bm.can_allocate(seq, 2 * BS)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 3 * BS)
    assert_all_free(bm)


def test_shared_prefix_is_reused_with_reference_counts():
    bm = BlockManager(16, BS)
    a = FakeSeq(list(range(10)))              # blocks [0..3] [4..7] full, [8, 9] partial
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 2          # only full blocks are published

    b = FakeSeq(list(range(8)) + [50, 51, 52])
    ids, hashes = bm.find_cached_prefix(b)
    assert ids == a.block_table[:2]
    assert hashes == a.block_hashes[:2]
    run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    refs = bm.ref_counts()
    assert [refs[i] for i in a.block_table] == [2, 2, 1]
    assert refs[b.block_table[2]] == 1
    assert bm.num_free_blocks == 16 - 4       # 3 blocks for a, one more for b

    bm.free_blocks(a)
    refs = bm.ref_counts()
    assert [refs[i] for i in b.block_table] == [1, 1, 1]
    bm.free_blocks(b)
    assert_all_free(bm)
    assert bm.num_cached_blocks == 2          # freed blocks keep their contents until evicted


def test_a_different_first_block_shares_nothing():
    bm = BlockManager(16, BS)
    run_prefill(bm, FakeSeq(range(12)))
    other = FakeSeq([7] + list(range(1, 12)))  # same tokens after the first: the chain differs
    assert bm.find_cached_prefix(other) == ([], [])


def test_the_last_token_is_always_recomputed():
    bm = BlockManager(16, BS)
    a = FakeSeq(range(2 * BS))
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 2
    repeat = FakeSeq(range(2 * BS))           # cached whole: its last block is still computed
    ids, _ = bm.find_cached_prefix(repeat)
    assert ids == a.block_table[:1]
    longer = FakeSeq(list(range(2 * BS)) + [77])
    ids, _ = bm.find_cached_prefix(longer)
    assert ids == a.block_table[:2]


def test_admit_counts_cached_tokens_as_computed():
    bm = BlockManager(16, BS)
    run_prefill(bm, FakeSeq(range(3 * BS)))
    b = FakeSeq(list(range(3 * BS)) + [1, 2])
    ids, hashes = bm.find_cached_prefix(b)
    bm.admit(b, ids, hashes, 2)
    assert b.num_computed_tokens == 3 * BS
    assert len(b.block_table) == 4


def test_hash_published_only_after_kv_written():
    bm = BlockManager(16, BS)
    a = FakeSeq(range(3 * BS))
    bm.admit(a, [], [], a.num_tokens)         # blocks for all 12 tokens, none computed yet
    bm.publish(a)
    assert bm.num_cached_blocks == 0 and a.block_hashes == []
    b = FakeSeq(list(range(3 * BS)) + [99])
    assert bm.find_cached_prefix(b) == ([], [])

    a.num_computed_tokens = BS + 2            # a chunk wrote the first block and half the second
    bm.publish(a)
    assert bm.num_cached_blocks == 1 and len(a.block_hashes) == 1
    assert bm.find_cached_prefix(b)[0] == a.block_table[:1]

    a.num_computed_tokens = 3 * BS
    bm.publish(a)
    assert bm.num_cached_blocks == 3
    assert bm.find_cached_prefix(b)[0] == a.block_table
    assert a.block_hashes[0] == hash_block(None, range(BS))
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], range(BS, 2 * BS))


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(6, BS)
    first = FakeSeq(range(0, 2 * BS))        # 2 full blocks each, both published
    second = FakeSeq(range(100, 100 + 2 * BS))
    run_prefill(bm, first)
    run_prefill(bm, second)
    first_table, second_table = list(first.block_table), list(second.block_table)
    bm.free_blocks(first)
    bm.free_blocks(second)
    assert bm.num_cached_blocks == 4
    empty = [b for b in range(6) if b not in first_table + second_table]

    def take():
        s = FakeSeq([0])
        bm.allocate(s, 1)
        return s.block_table[0]

    # Never-used blocks go first; then the cached ones, the earliest freed first, and within
    # one sequence its tail before its head.
    order = [take() for _ in range(6)]
    assert sorted(order[:2]) == sorted(empty)
    assert order[2:] == [first_table[1], first_table[0], second_table[1], second_table[0]]
    assert bm.num_cached_blocks == 0
    assert bm.num_free_blocks == 0


def test_a_cache_hit_refreshes_the_block():
    bm = BlockManager(4, BS)
    old = FakeSeq(range(0, BS + 1))
    new = FakeSeq(range(50, 50 + BS + 1))
    run_prefill(bm, old)
    run_prefill(bm, new)
    old_head, new_head = old.block_table[0], new.block_table[0]
    bm.free_blocks(old)
    bm.free_blocks(new)
    again = FakeSeq(list(range(0, BS)) + [7])  # reuses old's first block: it becomes the newest
    run_prefill(bm, again)
    assert again.block_table[0] == old_head
    bm.free_blocks(again)
    s = FakeSeq([0])
    bm.allocate(s, 3 * BS)   # takes the three least recently used: new's block is evicted first
    assert new_head in s.block_table
    assert old_head not in s.block_table
    assert bm.find_cached_prefix(FakeSeq(list(range(0, BS)) + [7]))[0] == [old_head]
    assert bm.find_cached_prefix(FakeSeq(list(range(50, 50 + BS)) + [7])) == ([], [])


def test_evicted_block_leaves_the_cache():
    bm = BlockManager(2, BS)
    a = FakeSeq(range(BS + 1))
    run_prefill(bm, a)
    bm.free_blocks(a)
    assert bm.num_cached_blocks == 1
    b = FakeSeq(range(200, 200 + 2 * BS))
    bm.allocate(b, 2 * BS)                    # needs both blocks: the cached one is evicted
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(FakeSeq(list(range(BS)) + [5])) == ([], [])


def test_hash_collision_compares_token_ids(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 12345)
    bm = BlockManager(16, BS)
    a = FakeSeq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 1
    b = FakeSeq([9, 9, 9, 9, 5])              # same (fake) hash, different tokens
    assert bm.find_cached_prefix(b) == ([], [])
    run_prefill(bm, b)
    assert b.block_table[0] != a.block_table[0]
    assert bm.blocks[b.block_table[0]].hash is None   # the colliding block is not published
    assert bm.find_cached_prefix(FakeSeq([1, 2, 3, 4, 6]))[0] == [a.block_table[0]]


def test_can_admit_counts_reusable_free_blocks():
    bm = BlockManager(3, BS)
    a = FakeSeq(range(2 * BS + 1))            # 3 blocks: the whole pool
    run_prefill(bm, a)
    bm.free_blocks(a)
    b = FakeSeq(list(range(2 * BS)) + [42, 43, 44])
    ids, hashes = bm.find_cached_prefix(b)
    assert len(ids) == 2
    assert bm.can_admit(b, ids, 3)            # 2 cached (free, reclaimed) + 1 new = 3 blocks
    assert not bm.can_admit(b, ids, BS + 3)   # 2 new blocks would be one too many
    bm.admit(b, ids, hashes, 3)
    assert bm.num_free_blocks == 0
    bm.free_blocks(b)
    assert_all_free(bm)


def test_prefix_caching_off():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = FakeSeq(range(3 * BS))
    run_prefill(bm, a)
    assert bm.num_cached_blocks == 0 and a.block_hashes == []
    assert bm.find_cached_prefix(FakeSeq(range(3 * BS))) == ([], [])
    bm.free_blocks(a)
    assert_all_free(bm)


def test_free_returns_every_block():
    bm = BlockManager(16, BS)
    seqs = [FakeSeq(range(i, i + 2 * BS + 1)) for i in range(0, 12, 3)]  # overlapping prefixes
    seqs.append(FakeSeq(range(0, 2 * BS + 1)))                         # a full repeat of the first
    for s in seqs:
        run_prefill(bm, s)
    assert bm.num_free_blocks < bm.num_blocks
    for s in seqs:
        bm.free_blocks(s)
        assert s.block_table == [] and s.block_hashes == [] and s.num_computed_tokens == 0
    assert_all_free(bm)


def test_block_hash_is_a_sha256_chain():
    first = hash_block(None, range(16))
    assert isinstance(first, bytes) and len(first) == 32
    assert hash_block(first, range(16)) != first                 # the parent is part of the name
    assert hash_block(None, range(16)) == first                  # deterministic
    assert hash_block(None, [0] * 16) != hash_block(None, [0] * 15 + [1])
