"""StateCache request lifecycle: admission, tracking, donation, finish per strategy, abort, eviction."""
from __future__ import annotations

import pytest
import torch

from batchinfer.cache.cache_config import CacheConfig
from batchinfer.cache.kv_pool import KVPool
from batchinfer.cache.shapes import GdnStateShape, KVShape
from batchinfer.cache.state_cache import StateCache
from batchinfer.cache.state_pool import GdnStatePool

RING = 4


def _cache(mode="extra_buffer", prefix_cache=True, kv_slots=64, state_slots=12) -> StateCache:
    kv = KVPool(kv_slots, KVShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32))
    shape = GdnStateShape(num_layers=1, conv_dim=6, conv_kernel=4, num_k_heads=1, num_v_heads=1, head_k_dim=2,
                          head_v_dim=2, conv_dtype=torch.float32, ssm_dtype=torch.float32, ring_len=RING)
    pool = GdnStatePool(state_slots, shape)
    for t in pool.conv + pool.ssm + pool.ring_k + pool.ring_u:  # garbage, as left by earlier tenants
        t.normal_()
    pool.cursor.fill_(2)
    return StateCache(kv, pool, CacheConfig(mode=mode, prefix_cache=prefix_cache))


def _tree_kv(cache, tokens):
    return cache.tree.match(tokens).kv_indices


def _feed(cache, seq, ids):
    """The engine's order: the ids join the sequence's own token list, then get KV slots."""
    seq.tokens.extend(ids)
    return cache.append(seq, len(ids))


def test_admit_fresh_zeroes_working_state_and_allocates():
    cache = _cache()
    seq = cache.admit("a", [3, 1, 4, 1, 5])
    pool = cache.state_pool
    assert seq.resume_len == 0 and seq.num_tokens == 5 and seq.kv_indices.numel() == 5
    assert not pool.conv[0][seq.working_slot].any() and not pool.ssm[0][seq.working_slot].any()
    assert int(pool.cursor[seq.working_slot]) == 0
    assert seq.state_slots() == [seq.working_slot] and cache.kv_pool.num_used == 5  # tracks on demand
    assert len(_cache(mode="no_buffer").admit("b", [1, 2]).state_slots()) == 1
    cache.audit()


def test_extra_buffer_track_donate_finish_then_resume():
    cache = _cache()
    prompt = [7, 7, 1, 2, 3, 4, 5, 6, 9]
    a = cache.admit("a", list(prompt))
    assert cache.track(a, 6) and a.filled_tracks[0][0] == 6
    tracked_slot = a.filled_tracks[0][1]
    assert cache.donate(a) == 1
    assert a.tree_len == 6 and a.locked_node.depth == 6 and a.locked_node.state_slot == tracked_slot
    assert a.state_slots() == [a.working_slot] and cache.state_pool.num_used == 2  # working + the tree's
    assert torch.equal(a.kv_indices[:6], _tree_kv(cache, prompt[:6]))
    cache.audit()
    assert _feed(cache, a, [11]).numel() == 1
    cache.finish(a)
    cache.audit()
    assert cache.tree.num_kv_tokens == 10 and cache.tree.num_states == 1  # KV of prompt+output, one state

    b = cache.admit("b", prompt[:6] + [8, 8])
    assert (b.resume_len, b.matched_kv_len) == (6, 6)
    assert torch.equal(b.kv_indices[:6], _tree_kv(cache, prompt[:6]))
    torch.testing.assert_close(cache.state_pool.ssm[0][b.working_slot], cache.state_pool.ssm[0][tracked_slot])
    c = cache.admit("c", prompt[:8] + [0])  # KV matches 8 tokens but the state is at 6
    stats = cache.stats()
    assert (c.resume_len, stats.kv_matched_tokens, stats.reused_tokens, stats.discarded_kv_tokens) == (6, 14, 12, 2)
    assert (stats.states_tracked, stats.states_donated) == (1, 1)
    cache.audit()


def test_no_buffer_inserts_final_state_only():
    cache = _cache(mode="no_buffer")
    prompt = [1, 2, 3, 4, 5]
    a = cache.admit("a", list(prompt))
    assert not cache.track(a, 3) and cache.donate(a) == 0
    cache.state_pool.cursor[a.working_slot] = 3  # pending ring entries at finish
    _feed(cache, a, [6])
    _feed(cache, a, [7])
    cache.finish(a)
    node = cache.tree.match(prompt + [6, 7, 8]).state_node
    assert node.depth == 7 and int(cache.state_pool.cursor[node.state_slot]) == 0  # flushed
    b = cache.admit("b", prompt + [9])  # shares the prompt only: the state at 7 is out of reach
    assert (b.resume_len, b.matched_kv_len) == (0, 5)
    assert cache.stats().discarded_kv_tokens == 5 and cache.stats().states_donated == 1
    cache.audit()


def test_sample_siblings_resume_from_state_one_before_the_end():
    cache = _cache()
    prompt = [4, 4, 4, 2]
    first = cache.admit("s0", prompt)
    cache.track(first, len(prompt) - 1)
    cache.donate(first)
    second = cache.admit("s1", prompt)
    assert second.resume_len == len(prompt) - 1
    cache.audit()


def test_without_prefix_cache_nothing_is_kept():
    cache = _cache(prefix_cache=False)
    a = cache.admit("a", [1, 2, 3])
    assert len(a.state_slots()) == 1 and not cache.track(a, 2)
    cache.finish(a)
    b = cache.admit("b", [1, 2, 3, 4])
    assert b.matched_kv_len == 0 and b.resume_len == 0
    cache.finish(b)
    cache.audit()
    assert cache.kv_pool.num_used == 0 and cache.state_pool.num_used == 0 and cache.tree.num_kv_tokens == 0


def test_abort_frees_everything_and_leaves_tree():
    cache = _cache()
    a = cache.admit("a", [1, 2, 3, 4, 5, 6])
    cache.track(a, 4)
    cache.donate(a)
    cache.finish(a)
    tree_before = (cache.tree.num_kv_tokens, cache.tree.num_states)
    b = cache.admit("b", [1, 2, 3, 4, 9, 9, 9])
    _feed(cache, b, [5])
    cache.track(b, 6)
    cache.abort(b)
    assert (cache.tree.num_kv_tokens, cache.tree.num_states) == tree_before
    assert cache.kv_pool.num_used == tree_before[0] and cache.state_pool.num_used == tree_before[1]
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())
    with pytest.raises(RuntimeError):
        cache.finish(b)
    cache.audit()


def test_concurrent_donation_of_the_same_prefix_dedups():
    cache = _cache()
    a = cache.admit("a", [1, 2, 3, 4, 5])
    b = cache.admit("b", [1, 2, 3, 4, 6])  # admitted before anything was cached
    for seq in (a, b):
        cache.track(seq, 4)
    assert cache.donate(a) == 1
    b_own_prefix = b.kv_indices[:4].clone()
    assert cache.donate(b) == 0  # the node already has a state: b's snapshot goes back to the pool
    assert torch.equal(b.kv_indices[:4], a.kv_indices[:4])
    assert set(b_own_prefix.tolist()).isdisjoint(set(a.kv_indices[:4].tolist()))
    assert cache.kv_pool.num_used == 4 + 1 + 1 and b.state_slots() == [b.working_slot]
    assert cache.state_pool.num_used == 3  # two working slots, one tree state
    cache.audit()


def test_third_track_donates_the_oldest_first():
    cache = _cache()
    seq = cache.admit("a", list(range(10)))
    for position in (3, 6, 9):
        assert cache.track(seq, position)
    assert [p for p, _ in seq.filled_tracks] == [6, 9] and cache.tree.match(list(range(5))).resume_len == 3
    assert not cache.track(seq, 2)  # not past what the tree already holds for this sequence
    cache.finish(seq)
    assert cache.tree.num_states == 3
    cache.audit()


def test_finish_with_uncomputed_tail_frees_it():
    cache = _cache()
    seq = cache.admit("a", [1, 2, 3])
    _feed(cache, seq, [4])
    cache.track(seq, 4)
    cache.finish(seq, computed_len=3)
    assert cache.tree.num_kv_tokens == 3 and cache.tree.num_states == 0 and cache.kv_pool.num_used == 3
    cache.audit()


def test_a_token_fed_before_its_id_is_known_is_cached_once_it_is():
    """Decode overlap: a token's KV slot is taken while its id is still on the device. The handle
    reads ids from the sequence's own list, so the tree takes that token only once it is there."""
    cache = _cache()
    tokens = [1, 2, 3]
    seq = cache.admit("a", tokens)
    assert seq.tokens is tokens                        # one list: the sequence's, by reference
    cache.append(seq, 1)                               # the 4th token is fed; its id is not known
    assert seq.num_tokens == 4 and len(tokens) == 3
    with pytest.raises(ValueError, match="known"):
        cache.finish(seq)
    assert cache.track(seq, 4)
    with pytest.raises(ValueError, match="known"):
        cache.donate(seq)
    cache.audit()                                      # neither took nor freed anything
    assert seq.num_tokens == 4 and len(seq.filled_tracks) == 1
    tokens.append(7)                                   # the id reaches the host
    assert cache.donate(seq) == 1
    cache.finish(seq)
    assert cache.tree.match([1, 2, 3, 7, 0]).resume_len == 4 and cache.tree.num_kv_tokens == 4
    cache.audit()


def test_ring_steps_mirror_the_cursor_and_count_full_rings():
    cache = _cache()                                   # its pool's cursors start at 2 (garbage)
    a = cache.admit("a", [1, 2, 3])
    assert a.ring_cursor == 0 == int(cache.state_pool.cursor[a.working_slot])
    folds = [cache.ring_steps([a]) for _ in range(2 * RING + 1)]
    assert folds == [0] * RING + [1] + [0] * (RING - 1) + [1] and a.ring_cursor == 1
    cache.finish(a)


def test_admission_evicts_lru_but_never_a_running_prefix():
    cache = _cache(kv_slots=12, state_slots=7)
    old = cache.admit("old", [5, 5, 5, 5])
    cache.track(old, 3)
    cache.finish(old)                                   # tree: 4 KV, 1 state (LRU)
    keep = cache.admit("keep", [1, 1, 1, 1])
    cache.track(keep, 3)
    cache.donate(keep)                                  # running, its prefix locked
    assert cache.admit("big", list(range(20, 29))) is None  # 9 KV: 4 free + 4 evictable is not enough
    assert cache.tree.num_kv_tokens == 7                # ... and nothing was evicted trying
    new = cache.admit("new", list(range(20, 28)))       # 8 KV: evicts "old" (KV and its state)
    assert new is not None and cache.stats().kv_evicted_tokens == 4 and cache.stats().states_evicted == 1
    assert cache.tree.match([1, 1, 1, 1]).resume_len == 3
    assert not cache.can_admit([9])                     # no KV slot left, nothing evictable
    cache.audit()


def test_kv_eviction_frees_a_slack_so_the_next_admissions_need_none():
    """Finding LRU leaves walks the whole tree, so one eviction frees at least 1/64 of the pool
    (when that much is evictable), not just the one slot asked for."""
    cache = _cache(kv_slots=256, state_slots=4)
    for i in range(64):                                 # 64 finished 4-token prompts fill the pool
        seq = cache.admit(f"p{i}", [1000 + i, 1, 2, 3])
        cache.finish(seq)
    assert cache.kv_pool.num_free == 0 and cache.tree.num_kv_tokens == 256
    first = cache.admit("a", [7])
    assert first is not None and cache.stats().kv_evicted_tokens == 256 // 64
    assert cache.tree.match([1000, 1, 2, 3]).kv_len == 0  # the least recently used went first
    for i in range(3):                                  # the slack covers the next three admissions
        assert cache.admit(f"b{i}", [8 + i]) is not None
    assert cache.stats().kv_evicted_tokens == 4
    cache.audit()


def test_audit_catches_ownership_and_lock_errors():
    cache = _cache()
    a = cache.admit("a", [1, 2, 3, 4])
    cache.track(a, 3)
    cache.donate(a)
    cache.audit()
    a.filled_tracks.append((4, a.working_slot))  # one slot, two owners
    with pytest.raises(AssertionError, match="two owners"):
        cache.audit()
    a.filled_tracks.pop()
    leaked = cache.kv_pool.alloc(1)  # allocated but owned by no one
    with pytest.raises(AssertionError, match="unowned"):
        cache.audit()
    cache.kv_pool.free(leaked)
    cache.tree.lock(a.locked_node)  # a lock nobody accounts for
    with pytest.raises(AssertionError, match="lock count"):
        cache.audit()
    cache.audit(external_locks=[a.locked_node])


# ---- on-demand track slots and unpinned states (1 state slot per running request) ----------

def _run_to(cache, seq, positions):
    """The engine's rhythm: the state reaches each position, is snapshotted and donated at once."""
    return [cache.track(seq, p) and cache.donate(seq) == 1 for p in positions]


@pytest.mark.parametrize("n", [3, 5])
def test_n_working_slots_and_two_cached_states_run_n_requests(n):
    """Room for exactly n working slots + 2 states: n requests sharing a prefix run at once and
    keep tracking (each snapshot evicts an older cached state, locked paths' included)."""
    cache = _cache(kv_slots=128, state_slots=n + 2)
    prefix = [9, 8, 7, 6, 5, 4]
    seqs = [cache.admit(i, prefix + [i, i + 1, i + 2]) for i in range(n)]
    assert all(s is not None for s in seqs)  # one slot each: three per request would admit (n + 2) // 3 at most
    assert _run_to(cache, seqs[0], [3, 6, 8]) == [True, True, True]
    cache.audit()
    for seq in seqs[1:]:
        assert _run_to(cache, seq, [7, 8]) == [True, True]
        assert cache.state_pool.num_used == n + 2 and seq.state_slots() == [seq.working_slot]
        cache.audit()
    stats = cache.stats()
    assert stats.states_tracked == 3 + 2 * (n - 1) and stats.tracks_skipped == 0
    assert stats.states_evicted == stats.states_tracked - 2
    follower = cache.match(prefix + [99, 99])
    assert follower.kv_len == 6 and follower.resume_len == 0  # the prefix states were evicted, not its KV
    for seq in seqs:
        cache.finish(seq)
    cache.audit()
    assert cache.state_pool.num_used == cache.tree.num_states == 2


def test_locked_node_state_evicted_under_pressure_but_not_its_kv():
    cache = _cache(kv_slots=64, state_slots=3)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a = cache.admit("a", list(prompt))
    assert _run_to(cache, a, [4]) == [True]            # a holds the node at 4 locked
    node = a.locked_node
    assert node.lock_ref == 1 and node.state_slot is not None
    b = cache.admit("b", [5, 5, 5])                    # the last free slot
    c = cache.admit("c", [6, 6, 6])                    # no free slot: a's locked state goes
    assert b is not None and c is not None and node.state_slot is None
    assert cache.stats().states_evicted == 1 and cache.stats().kv_evicted_tokens == 0
    assert node.lock_ref == 1 and torch.equal(a.kv_indices[:4], _tree_kv(cache, prompt[:4]))
    assert cache.match(prompt).kv_len == 4 and cache.match(prompt).resume_len == 0
    cache.audit()
    _feed(cache, a, [8])
    cache.finish(a)                                    # a is unaffected: it never reads the tree's state
    assert cache.match(prompt + [8, 0]).kv_len == 8
    cache.audit()


def test_admission_pins_the_state_it_resumes_from():
    cache = _cache(kv_slots=64, state_slots=4)
    shared = [3, 3, 3, 3]
    a = cache.admit("a", shared + [1, 1])
    assert _run_to(cache, a, [4]) == [True]            # the shared state: the least recently used
    other = cache.admit("other", [7, 7, 7])
    assert _run_to(cache, other, [2]) == [True]
    assert cache.state_pool.num_free == 0              # 2 working slots + 2 tree states
    stats_before = cache.stats()
    b = cache.admit("b", shared + [2, 2])              # must evict a state, never the one it copies
    assert b is not None and b.resume_len == 4
    assert cache.stats().states_evicted == stats_before.states_evicted + 1
    assert cache.match(shared + [2]).resume_len == 4   # still cached after the copy
    cache.audit()
    cache.finish(other)
    cache.finish(a)
    full = _cache(kv_slots=64, state_slots=2)          # one working slot + the one cached state
    a = full.admit("a", shared + [1, 1])
    assert _run_to(full, a, [4]) == [True]
    assert full.admit("b", shared + [2, 2]) is None    # the only evictable state is b's own source
    assert not full.can_admit(shared + [2, 2])
    assert full.match(shared + [2]).resume_len == 4 and full.stats().states_evicted == 0
    full.audit()


def test_track_without_any_free_or_evictable_slot_is_skipped():
    cache = _cache(kv_slots=64, state_slots=2)
    a, b = cache.admit("a", [1, 2, 3, 4]), cache.admit("b", [5, 6, 7])
    assert cache.state_pool.num_free == 0
    assert not cache.track(a, 3) and cache.donate(a) == 0
    stats = cache.stats()
    assert (stats.tracks_skipped, stats.states_tracked) == (1, 0)
    cache.finish(b)                                    # its working slot frees: tracking works again
    assert _run_to(cache, a, [4]) == [True]
    assert cache.stats().tracks_skipped == 1
    cache.finish(a)
    cache.audit()


def _decode_fleet(cache, seed=0):
    """Three running sequences of odd lengths (one long enough to outgrow its first buffer), in
    a pool left shuffled by earlier frees, so slots are out of order."""
    rng = torch.Generator().manual_seed(seed)
    spare = cache.kv_pool.alloc(9)
    seqs = [cache.admit(f"s{i}", torch.randint(0, 50, (n,), generator=rng).tolist()) for i, n in enumerate((3, 7, 17))]
    cache.kv_pool.free(spare[torch.randperm(9, generator=rng)])
    return seqs


def test_append_many_takes_the_same_slots_as_one_append_per_sequence():
    batched, single = _cache(kv_slots=200), _cache(kv_slots=200)
    fleet_a, fleet_b = _decode_fleet(batched), _decode_fleet(single)
    for step in range(40):  # past every handle's first buffer (2 × its prompt, at least 16)
        ids = [100 + 3 * step + i for i in range(3)]
        for seq, token in zip(fleet_a, ids):
            seq.tokens.append(token)
        assert batched.append_many(fleet_a)
        for seq, token in zip(fleet_b, ids):
            _feed(single, seq, [token])
        for a, b in zip(fleet_a, fleet_b):
            assert a.num_tokens == b.num_tokens and torch.equal(a.kv_indices, b.kv_indices)
    batched.audit()
    assert batched.append_many([])


def test_append_many_is_all_or_nothing_and_evicts_for_room():
    cache = _cache(kv_slots=24)
    done = cache.admit("done", [9, 8, 7, 6, 5, 4])
    cache.finish(done)  # 6 evictable KV slots in the tree
    seqs = [cache.admit("a", [1] * 7), cache.admit("b", [2] * 9)]  # 24 - 6 - 16 = 2 free
    assert cache.append_many(seqs) and cache.kv_pool.num_free == 0
    assert cache.append_many(seqs) and cache.stats().kv_evicted_tokens >= 2  # evicted the tree's
    before = [s.kv_indices.clone() for s in seqs]
    cache.evict(100)  # nothing left to evict; then leave one free slot: room for one token, not two
    held = cache.kv_pool.alloc(cache.kv_pool.num_free - 1)
    assert not cache.append_many(seqs)
    assert cache.kv_pool.num_free == 1 and [s.num_tokens for s in seqs] == [9, 11]
    assert all(torch.equal(a, s.kv_indices) for a, s in zip(before, seqs))
    cache.kv_pool.free(held)
    cache.audit()


def test_pack_kv_concatenates_every_context():
    from batchinfer.cache.seq_handle import pack_kv

    cache = _cache(kv_slots=200)
    seqs = _decode_fleet(cache, seed=1)
    for step in range(25):
        cache.append_many(seqs)
        order = [seqs[2], seqs[0], seqs[1]]
        assert torch.equal(pack_kv(order), torch.cat([s.kv_indices for s in order]))
    assert pack_kv([]).numel() == 0


def test_expected_followers_keep_a_branch_state_until_admitted():
    """3 state slots: a leader's working slot, its donated branch state (2 followers expected),
    and one spare. Interval tracks may only churn the spare; the followers' admissions release
    the branch state, which is then as evictable as any other."""
    cache = _cache(state_slots=3)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    leader = cache.admit("lead", prompt)
    assert cache.track(leader, 4) and cache.donate(leader) == 1
    assert not cache.expect_followers(leader, 4, 0)  # nobody to wait for: nothing to keep
    assert cache.expect_followers(leader, 4, 2) and not cache.expect_followers(leader, 3, 1)  # no state at 3
    branch = cache.tree.node_at(prompt, 4)
    for position in (5, 6, 7):  # each takes the spare slot, evicting the previous interval state
        assert cache.track(leader, position) and cache.donate(leader) == 1
        assert branch.state_slot is not None
    assert cache.stats().states_evicted == 2
    cache.finish(leader)
    first = cache.admit("f1", prompt[:4] + [1, 2], planned_resume=4)
    assert first.resume_len == 4 and branch.followers == 1
    cache.finish(first)
    second = cache.admit("f2", prompt[:4] + [3], planned_resume=4)
    assert second.resume_len == 4 and branch.followers == 0
    cache.finish(second)
    cache.audit()
    assert branch.state_slot is not None and cache.tree.evictable(spare_expected=True)[1] == cache.tree.num_states
