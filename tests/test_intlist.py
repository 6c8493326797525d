"""IntList: a live map / the ledger's positions keep an int64 tensor of themselves that follows every edit (appends
extend it, evictions gather it, anything else drops it), and the positions a policy reads through it equal the
positions gathered entry by entry."""
import random

import pytest
import torch

from kvlab.cache.intlist import IntList, int_list
from kvlab.cache.mirror import LivePositions, positions_tensor


def _same(x: IntList) -> bool:
    return x.tensor().tolist() == list(x)


def test_appends_extend_the_tensor_and_other_edits_drop_it():
    x = IntList(range(10))
    t = x.tensor()
    x.append(10)
    x.extend([11, 12])
    x += [13]
    assert x.version == 0 and x._t is t                 # appends: the old tensor is still a valid prefix
    assert _same(x) and x.tensor().shape == (14,)
    edits = [lambda y: y.__setitem__(0, 99), lambda y: y.__setitem__(slice(1, 3), [7]), lambda y: y.__delitem__(2),
             lambda y: y.__delitem__(slice(5, None)), lambda y: y.insert(1, 5), lambda y: y.pop(), lambda y: y.pop(0),
             lambda y: y.remove(4), lambda y: y.sort(reverse=True), lambda y: y.reverse(), lambda y: y.__imul__(2),
             lambda y: y.clear()]
    for edit in edits:
        y = int_list(range(8))
        y.tensor()
        v = y.version
        edit(y)
        assert y.version == v + 1 and y._t is None, edit
        assert _same(y)


def test_drop_slots_gathers_the_tensor_and_copies_share_it():
    x = IntList(range(100, 120))
    x.tensor()
    slots = [0, 3, 4, 19]
    kept = torch.tensor([i for i in range(20) if i not in slots])
    x.drop_slots(slots, kept)
    assert x._t is not None and x._t.tolist() == list(x)   # followed by a gather, not dropped
    assert list(x) == [100 + i for i in range(20) if i not in slots] and _same(x)
    y = x.copy()
    assert isinstance(y, IntList) and y._t is x._t and list(y) == list(x)
    y.append(5)
    assert _same(y) and _same(x) and len(x) == 16       # a copy's appends leave the original as it was
    z = IntList(range(5))                               # no cached tensor: drop_slots leaves none
    z.drop_slots([1], torch.tensor([0, 2, 3, 4]))
    assert z._t is None and list(z) == [0, 2, 3, 4] and _same(z)


def test_live_positions_keep_their_snapshot_after_any_edit():
    pos = IntList(range(0, 40, 2))                       # ledger positions (row r at position 2r)
    live = IntList(range(20))
    live.tensor()
    snap = LivePositions(pos, live)
    live.append(3)                                       # appends: the snapshot reads the list's tensor prefix
    assert snap.rows_tensor().tolist() == list(range(20))
    assert positions_tensor([snap]).tolist() == [list(range(0, 40, 2))]
    live.drop_slots([0, 1], torch.arange(2, 21))         # an eviction after the snapshot (and appends that make the
    live.extend([30, 31, 32])                            # list as long again): read from its own copy
    assert len(live) >= 20 and snap.rows_tensor().tolist() == list(range(20))
    assert positions_tensor([snap], 2, 5).tolist() == [[4, 6, 8]]
    plain = LivePositions(list(range(0, 40, 2)), [3, 1, 2])   # plain lists: the same numbers, built from the lists
    assert positions_tensor([plain]).tolist() == [[6, 2, 4]]


def test_a_snapshot_of_an_intlist_reads_its_tensor_while_only_appends_follow():
    """Taken from an IntList, a LivePositions reads the list's prefix (no copy; the list keeps no tensor for it: a
    policy that never reads positions as a tensor costs no conversion); read as a tensor it is the list's own while
    only appends followed (made once, then a prefix), its own copy (handed over before the edit) after any other edit
    (item assignment, deletes, truncation, evictions), and it stays as taken read as a tensor, a sequence, a slot or a
    slice."""
    pos = IntList(range(0, 40, 2))
    live = IntList(range(10))
    first = LivePositions(pos, live)
    assert live.tensor_len == 0 and first._rows is None            # taking it made no tensor and no copy
    t = first.rows_tensor()                                        # read as a tensor: the list's own, made once
    assert live.tensor_len == 10 and t.data_ptr() == live.tensor().data_ptr() and t.tolist() == list(range(10))
    live.append(10)
    snap = LivePositions(pos, live)
    assert snap.rows_tensor().tolist() == list(range(11)) and first.rows_tensor().tolist() == list(range(10))
    live[0] = 9                                                    # an in-place edit of the list: a new tensor next
    del live[5:]
    live.drop_slots([1], torch.tensor([0, 2, 3, 4]))
    live.append(19)
    assert snap.rows_tensor().tolist() == list(range(11)) and live.tensor().tolist() == [9, 2, 3, 4, 19]
    assert list(snap) == list(range(0, 22, 2)) and snap[3] == 6 and snap[2:4] == (4, 6) and len(snap) == 11
    assert first == tuple(range(0, 20, 2)) and first == LivePositions(pos, list(range(10)))
    assert first.rows_tensor().tolist() == list(range(10))         # edited since: read from its own copy
    stale = IntList(range(200))
    stale.tensor()
    stale[0] = 5                                                   # an edit drops the tensor (re-rotation's kind)
    cold = LivePositions(IntList(range(400)), stale)
    assert stale.tensor_len == 0 and cold.rows_tensor().tolist() == [5] + list(range(1, 200))
    assert stale.tensor_len == 200                                 # and its tensor read made the list's own


@pytest.mark.parametrize("edit", ["drop_slots", "setitem", "delslice", "insert", "pop", "remove", "clear", "sort",
                                  "reverse", "imul"])
def test_a_snapshot_copies_its_prefix_just_before_an_edit(edit):
    """A snapshot of an IntList holds no copy while only appends follow; any other edit hands every snapshot still
    alive its own copy of the prefix it was taken at (and nothing to one that is gone), so each reads as taken."""
    pos = IntList(range(0, 60, 2))
    live = IntList([4, 1, 7, 3, 9, 0])
    snaps = [LivePositions(pos, live)]
    live.append(5)
    snaps.append(LivePositions(pos, live))
    gone = LivePositions(pos, live)
    del gone                                                       # released before the edit: nothing to copy
    live.extend([8, 2])
    assert all(s._rows is None for s in snaps) and snaps[1][-1] == 10 and snaps[0][-1] == 0
    before = [list(s) for s in snaps]
    {"drop_slots": lambda: live.drop_slots([0, 2]), "setitem": lambda: live.__setitem__(1, 11),
     "delslice": lambda: live.__delitem__(slice(2, None)), "insert": lambda: live.insert(0, 12),
     "pop": lambda: live.pop(0), "remove": lambda: live.remove(7), "clear": live.clear, "sort": live.sort,
     "reverse": live.reverse, "imul": lambda: live.__imul__(2)}[edit]()
    assert [s._rows for s in snaps] == [[4, 1, 7, 3, 9, 0], [4, 1, 7, 3, 9, 0, 5]]    # the prefixes, not the appends
    assert [list(s) for s in snaps] == before == [[8, 2, 14, 6, 18, 0], [8, 2, 14, 6, 18, 0, 10]]
    assert [len(s) for s in snaps] == [6, 7] and snaps[1][2:5] == (14, 6, 18) and snaps[0][-1] == 0
    assert [s.rows_tensor().tolist() for s in snaps] == [[4, 1, 7, 3, 9, 0], [4, 1, 7, 3, 9, 0, 5]]
    with pytest.raises(IndexError):
        snaps[0][6]
    live.append(1)
    live.drop_slots([0], torch.arange(1, len(live)))              # a second edit: nothing left to hand over
    assert [s._rows for s in snaps] == [[4, 1, 7, 3, 9, 0], [4, 1, 7, 3, 9, 0, 5]]


def test_snapshots_no_edit_follows_are_pruned_as_they_go():
    """A live map viewed at every step and never edited keeps only its live snapshots' references (pruned as they
    pile up), and those it keeps still get their copies at the next edit."""
    pos = IntList(range(100))
    live = IntList(range(10))
    kept = []
    for step in range(500):
        snap = LivePositions(pos, live)
        if step % 50 == 0:
            kept.append(snap)
        live.append(10 + step % 80)
    assert len(live._snaps) < 130
    live.drop_slots([0], torch.arange(1, len(live)))
    assert [len(s) for s in kept] == [10 + 50 * k for k in range(10)] and all(s._rows is not None for s in kept)
    assert [s[0] for s in kept] == [0] * 10 and not live._snaps


def test_an_intlist_pickles_and_copies_without_its_snapshots():
    import copy
    import pickle
    live = IntList(range(5))
    live.tensor()
    snap = LivePositions(IntList(range(10)), live)
    for twin in (pickle.loads(pickle.dumps(live)), copy.deepcopy(live), live.copy()):
        assert list(twin) == list(range(5)) and type(twin) is IntList and "_snaps" not in twin.__dict__
        twin.drop_slots([0])
    assert snap._rows is None and list(snap) == list(range(5))


def test_live_positions_equality_by_rows_and_by_positions():
    """Two snapshots of one ledger are equal when their rows are; different rows that give the same positions are
    equal too (compared as positions), and different positions are not."""
    pos = IntList([0, 2, 4, 4, 8])                                 # rows 2 and 3 share position 4
    a, b = IntList([0, 1, 2]), IntList([0, 1, 2])
    a.tensor(), b.tensor()
    sa, sb = LivePositions(pos, a), LivePositions(pos, b)
    assert sa._src is not sb._src and sa == sb
    c = IntList([0, 1, 3])
    c.tensor()
    assert LivePositions(pos, c) == sa                              # other rows, the same positions
    d = IntList([0, 1, 4])
    d.tensor()
    assert LivePositions(pos, d) != sa and LivePositions(pos, [0, 1]) != sa
    assert LivePositions(pos, [0, 1, 2]) == sa == (0, 2, 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_positions_follow_a_decoding_cache_through_evictions_and_surgery(tiny_teacher, seed):
    """A real cache: decode steps, per-layer evictions, a delete and an insert; after each, the tensor path of every
    layer's positions equals the positions gathered one by one from the ledger."""
    from kvlab.cache import KVCache

    rng = random.Random(seed)
    model = tiny_teacher.model
    c = KVCache()
    c.forward(model, [rng.randrange(50) for _ in range(24)], writer="teacher")

    def check():
        lp = c.live_positions()
        want = [[c.ledger.position[r] for r in live] for live in c._mirror.lives]
        assert [list(p) for p in lp] == want
        got = positions_tensor(list(lp))
        assert got.tolist() == want
        assert [r.tolist() for r in (s.rows_tensor() for s in lp)] == [list(x) for x in c._mirror.lives]

    check()
    c.delete(3, model, writer="teacher")                  # surgery (a uniform cache), then a re-rotating eviction
    check()
    c.insert(5, [7, 8], model, writer="teacher")
    check()
    c.evict([0, 4], model=model, rerotate=True)
    check()
    for step in range(6):                                 # decode steps with per-layer evictions
        c.forward(model, [rng.randrange(50)], writer="student", step=step)
        n = len(c)
        layers = [sorted(rng.sample(range(n - 2), 2)) for _ in range(c.num_layers)]
        c.evict([], layers=layers)
        check()
    d = c.copy()
    d.forward(model, [1], writer="student", step=10)
    check()
    c.forward(model, [9], writer="student", step=9)
    check()


def test_tensors_of_several_lists_at_once():
    """IntList.tensors: equally long lists whose cached tensors are equally long (a batch's live maps) are read as
    one (G, n) tensor (cached parts stacked, tails converted together) and each keeps its row as its tensor; the
    next edit's gather follows from it. Lists unlike each other (cached lengths, none cached) are read one by one:
    the same numbers either way, and a pure-Python copy of each list agrees."""
    lists = [IntList(range(10 * g, 10 * g + 6)) for g in range(3)]
    for x in lists:
        x.tensor()
        x.extend([100 + len(x), 200])
    got = IntList.tensors(lists)
    assert got.tolist() == [list(x) for x in lists]
    assert all(x.tensor_len == 8 and x._t.data_ptr() == got[g].data_ptr() for g, x in enumerate(lists))
    lists[1].drop_slots([0, 3], torch.tensor([1, 2, 4, 5, 6, 7]))
    assert lists[1].tensor().tolist() == list(lists[1]) == [11, 12, 14, 15, 106, 200]
    mixed = [IntList(range(5)), IntList(range(5, 10))]
    mixed[0].tensor()                                               # one cached, one not: one by one
    assert IntList.tensors(mixed).tolist() == [list(range(5)), list(range(5, 10))]
    assert IntList.tensors([lists[0]]).tolist() == [list(lists[0])]
