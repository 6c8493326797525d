"""Per-entry attention statistics of a :class:`~kvlab.cache.KVCache`, for eviction policies.
Part of the cache module: only the statistics tensors, edited in the same call as the cache's other edits.

:class:`AttnStats` keeps, per layer and live entry of that layer, the accumulated attention mass
(H2O), its EMA (Conf-KV) and how many measured forwards saw the entry (NORM_SUM). Layer ``l``'s
statistics are ``(T_l,)`` tensors over that layer's own live slots (per-layer live sets). The cache
edits them in the same call as the tensors and the live maps (append, keep, remap, truncate), so
they always follow the live slots. The mass itself is measured by the attention computation
(:class:`~kvlab.cache.mass.MassSink`, filled by the ``"kvlab"`` attention function).
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch

NAMES = ("acc", "ema", "count")
EMA_PREFILL = ("query", "sum")


class AttnStats:
    """``data[name][l]``: a ``(T_l,)`` float32 tensor per layer ``l``, for ``name`` in acc, ema, count
    (and low, when ``below``: Scissorhands' count of queries that gave the entry < 1/T).

    ``window``: only the last ``window`` queries of a forward are measured (None: all);
    ``pool``: each forward's mass is max-pooled over this many entries; ``ema_prefill``: ``"query"``
    folds a multi-token forward into the EMA as one update per measured query in query order,
    ``"sum"`` as one update with the summed mass (see :meth:`kvlab.cache.KVCache.track_attention`)."""

    columns_deferred = False    # the last deferred step kept its statistics in bank columns (defer(None, ...))

    def __init__(self, ema_decay: float, lengths: Sequence[int], device, window: int | None = None, pool: int = 1,
                 below: bool = False, ema_prefill: str = "query"):
        if ema_prefill not in EMA_PREFILL:
            raise ValueError(f"ema_prefill={ema_prefill!r} must be one of {EMA_PREFILL}")
        self.ema_decay = float(ema_decay)
        self.ema_prefill = ema_prefill
        self.window, self.pool, self.below = window, pool, below
        self.device = device
        self._mats: dict[str, tuple] = {}   # name -> (matrix, its rows or None): data[name] as one (L, T) tensor
        self._owed = 0                      # zero columns a deferring row's appends owe its matrices (_pad_stacked)
        self.data = {k: [torch.zeros(n, device=device) for n in lengths] for k in self.names}
        self.pending: list[tuple] = []      # deferred steps (kvlab.cache.deferred): (queries (L, B, H, D), row, lengths)
        self.pending_scaling: list[float] = []

    @property
    def data(self) -> dict[str, list[torch.Tensor]]:
        """``{name: [t_0, …, t_{L-1}]}``; a statistic held as one matrix gets its rows (views) built here, once."""
        self._pay()
        for k, rows in self._data.items():
            if rows is None:
                mat = self._mats[k][0]
                got = mat.unbind(0)
                self._data[k], self._mats[k] = list(got), (mat, got)
        return self._data

    @data.setter
    def data(self, value: dict[str, list[torch.Tensor]]) -> None:
        self._data = value

    def _matrix(self, name: str, pay: bool = True) -> torch.Tensor | None:
        """The ``(L, T)`` matrix ``data[name]`` is (a stacked update made it, and nothing replaced a row since),
        else None. ``pay=False``: as it stands, without the columns deferred appends owe."""
        if pay:
            self._pay()
        ts, got = self._data[name], self._mats.get(name)
        if got is None:
            return None
        if ts is None:
            return got[0]
        if got[1] is not None and len(got[1]) == len(ts) and all(map(operator.is_, got[1], ts)):
            return got[0]
        return None

    def _lengths(self) -> list[int]:
        """Entries per layer (of ``acc``), without building per-layer rows."""
        m = self._matrix("acc", pay=False)                                 # (owed columns: only on matrices)
        return [int(m.shape[1]) + self._owed] * int(m.shape[0]) if m is not None else \
            [int(t.shape[0]) for t in self._data["acc"]]

    def _stack(self, name: str) -> torch.Tensor:
        """``data[name]`` as one ``(L, T)`` matrix: :meth:`_matrix` when there is one, else a stacked copy."""
        m = self._matrix(name)
        return m if m is not None else torch.stack(self.data[name])

    def _pay(self) -> None:
        """Append the zero columns deferred appends owe (:meth:`_pad_stacked`): before anything reads a statistic."""
        owed, self._owed = self._owed, 0
        if owed:
            for name in list(self._data):
                self._set(name, torch.nn.functional.pad(self._stack(name), (0, owed)))

    def _set(self, name: str, mat: torch.Tensor) -> None:
        """``data[name]`` := the rows of ``mat`` ``(L, T)`` (built when :attr:`data` is read)."""
        self._data[name] = None
        self._mats[name] = (mat, None)

    def _set_layers(self, name: str, ts: list[torch.Tensor]) -> None:
        """``data[name]`` := ``ts`` (one ``(T_l,)`` tensor per layer; layers of different lengths)."""
        self._data[name] = list(ts)
        self._mats.pop(name, None)

    @property
    def query_decay(self) -> float | None:
        """β when the EMA takes per-query updates (the query capture then weights each query), else None."""
        return self.ema_decay if self.ema_prefill == "query" else None

    @property
    def names(self) -> tuple[str, ...]:
        """The statistics kept: acc, ema, count, and ``low`` when ``below`` (Scissorhands)."""
        return NAMES + ("low",) if self.below else NAMES

    def set_layers(self, layers: int, n: int, device=None) -> None:
        """Tracking started before the cache had layers: one row of ``n`` zeros per layer, on ``device`` (the
        storage's, which an empty cache did not know yet)."""
        if len(self._lengths()) != layers:
            self.device = torch.device(device) if device is not None else self.device
            self._owed = 0
            self.data = {k: [torch.zeros(n, device=self.device) for _ in range(layers)] for k in self.names}

    def check(self, lengths: Sequence[int]) -> None:
        if lengths and min(lengths) == max(lengths) and all(
                (m := self._matrix(k, pay=False)) is not None and m.shape[0] == len(lengths)
                and m.shape[1] + self._owed == lengths[0] for k in self._data):
            return                          # every statistic is one (L, T) matrix of the right width (owed included)
        for name, ts in self.data.items():
            if len(ts) != len(lengths):
                raise AssertionError(f"attention stat {name!r} has {len(ts)} layers, live maps {len(lengths)}")
            for i, (t, n) in enumerate(zip(ts, lengths)):
                if t.shape[-1] != n:
                    raise AssertionError(f"attention stat {name!r} of layer {i} has {t.shape[-1]} entries, "
                                         f"live map {n}")

    def nbytes(self) -> int:
        total = 0
        for k in self._data:
            m = self._matrix(k)
            total += m.numel() * m.element_size() if m is not None else sum(t.numel() * t.element_size()
                                                                            for t in self.data[k])
        return total

    def copy(self) -> "AttnStats":
        new = AttnStats.__new__(AttnStats)
        new.ema_decay, new.device, new.window, new.pool = self.ema_decay, self.device, self.window, self.pool
        new.below, new.ema_prefill = self.below, self.ema_prefill
        new.pending, new.pending_scaling = list(self.pending), list(self.pending_scaling)
        new.columns_deferred = self.columns_deferred
        new._owed = 0                       # (the reads below pay this one's first)
        new._mats, new.data = {}, {}
        for k in self._data:
            m = self._matrix(k)
            if m is not None:
                new._set(k, m.clone())
            else:
                new._data[k] = [t.clone() for t in self.data[k]]
        return new

    def append(self, n: int, mass: Sequence[torch.Tensor] | None, low: Sequence[torch.Tensor] | None = None,
               ema_mass: Sequence[torch.Tensor] | None = None) -> None:
        """``n`` new entries (zeros) on every layer, then fold in one forward's ``mass`` (per layer
        ``(T_l,)``, the new entries last) if measured (and, when ``below``, its ``low`` counts, per
        layer ``(T_l,)``). ``ema_mass`` (per layer ``(T_l,)``, :meth:`QueryCapture.mass` with ``decay``):
        the EMA takes the forward's ``w`` measured queries as ``w`` updates in query order,
        ``ema ← β^w·ema + (1-β)·ema_mass``; without it, one update ``ema ← β·ema + (1-β)·mass``."""
        w = n if self.window is None else min(self.window, n)
        if mass is not None:
            self._no_pending("a measured append")
        if self._lengths() and self._append_stacked(n, w, mass, low, ema_mass):
            return
        if mass is None and self._pad_stacked(n):
            return
        a = self.data
        z = torch.zeros(n, device=self.device)
        incs: dict[int, torch.Tensor] = {}          # lifetime increment per layer length (layers alike share one)
        for i in range(len(a["acc"])):
            acc, ema, count = (torch.cat([a[k][i], z]) for k in NAMES)
            if mass is not None:
                m = max_pool_next(mass[i].to(self.device).view(1, -1), self.pool)[0]   # (T_l,)
                acc = acc + m
                if ema_mass is not None:
                    e = max_pool_next(ema_mass[i].to(self.device).view(1, -1), self.pool)[0]   # (T_l,)
                    ema = self.ema_decay ** w * ema + (1.0 - self.ema_decay) * e
                else:
                    ema = self.ema_decay * ema + (1.0 - self.ema_decay) * m
                t = count.shape[0]
                if t not in incs:
                    incs[t] = lifetime_increment(t, n, self.window).to(self.device)
                count = count + incs[t]
            a["acc"][i], a["ema"][i], a["count"][i] = acc, ema, count
            if self.below:
                lo = torch.cat([a["low"][i], z])
                a["low"][i] = lo + low[i].to(self.device) if (mass is not None and low is not None) else lo

    def defer(self, queries: torch.Tensor, row: int, lengths: list[int], scaling: list[float]) -> None:
        """A deferred one-token step (:mod:`kvlab.cache.deferred`), after its entry was appended unmeasured:
        ``queries[:, row]`` ``(L, H, D)`` are its queries (None: its probabilities were added into its bank row's
        columns, :class:`~kvlab.cache.deferred.ColumnSink`), ``lengths`` each layer's length after it."""
        self.pending.append((queries, row, list(lengths)))
        self.columns_deferred = queries is None
        if scaling is not None:             # (None: the step's statistics wait in bank columns, deferred.ColumnSink)
            self.pending_scaling = scaling  # per layer, the same at every step (one list per batched step)

    def fold(self, n: int, adds: dict) -> None:
        """Fold ``n`` deferred queries' statistics in (:func:`kvlab.cache.deferred.settle`): per layer
        ``acc += adds["acc"][l]``, ``ema ← β^n·ema + (1-β)·adds["ema_in"][l]``, ``count += adds["count"][l]``
        and, when ``below``, ``low += adds["low"][l]`` (each ``(T_l,)``; or one ``(L, T)`` matrix per statistic)."""
        b = self.ema_decay
        lengths = self._lengths()
        if lengths and len(set(lengths)) == 1:                           # one (L, T) op per statistic
            mat = {k: v if isinstance(v, torch.Tensor) else torch.stack(v)               # (L, T) each
                   for k, v in adds.items() if k != "low" or self.below}
            self._set("acc", self._stack("acc") + mat["acc"])
            self._set("ema", b ** n * self._stack("ema") + (1.0 - b) * mat["ema_in"])
            self._set("count", self._stack("count") + mat["count"])
            if self.below:
                self._set("low", self._stack("low") + mat["low"])
            return
        a = self.data
        for i in range(len(lengths)):
            a["acc"][i] = a["acc"][i] + adds["acc"][i]
            a["ema"][i] = b ** n * a["ema"][i] + (1.0 - b) * adds["ema_in"][i]
            a["count"][i] = a["count"][i] + adds["count"][i]
            if self.below:
                a["low"][i] = a["low"][i] + adds["low"][i]

    def _no_pending(self, what: str) -> None:
        if self.pending:
            raise RuntimeError(f"attention statistics: {what} with deferred queries pending (the cache settles them "
                               "before any edit: KVCache._settle)")

    def _append_stacked(self, n: int, w: int, mass, low, ema_mass) -> bool:
        """:meth:`append` for every layer at once when the layers hold equally many entries and the forward
        was measured: the statistics as ``(L, T)`` matrices, a few ops in all instead of a dozen per layer
        (the same arithmetic, elementwise). Each layer's tensor is then a row (view) of the result. False
        (nothing done) when layers differ in length or nothing was measured."""
        lengths = self._lengths()
        t = lengths[0]
        if mass is None or any(x != t for x in lengths):
            return False
        dev = self.device
        mat = lambda x: (x if isinstance(x, torch.Tensor) else torch.stack(x)).to(dev)  # noqa: E731 (L, T + n)
        m = max_pool_next(mat(mass), self.pool)                                            # (L, T + n)
        if m.shape[1] != t + n:
            return False
        grow = lambda name: torch.nn.functional.pad(self._stack(name), (0, n))           # noqa: E731 (L, T + n)
        acc = grow("acc") + m
        if ema_mass is not None:
            e = max_pool_next(mat(ema_mass), self.pool)
            ema = self.ema_decay ** w * grow("ema") + (1.0 - self.ema_decay) * e
        else:
            ema = self.ema_decay * grow("ema") + (1.0 - self.ema_decay) * m
        count = grow("count") + lifetime_increment(t + n, n, self.window).to(dev)
        self._set("acc", acc)
        self._set("ema", ema)
        self._set("count", count)
        if self.below:
            lo = grow("low")
            self._set("low", lo + mat(low) if low is not None else lo)
        return True

    def _pad_stacked(self, n: int) -> bool:
        """An unmeasured :meth:`append` when the layers hold equally many entries: each statistic one ``(L, T)``
        matrix padded with ``n`` zero columns (one op per statistic, not one per layer: a deferred step appends
        unmeasured at every step). False (nothing done) when layers differ in length or there are none. A row
        whose steps defer (``pending``) owes the columns instead (:meth:`_pay`, at the next read: its fold)."""
        m = self._matrix("acc", pay=False)
        if m is None:                                                   # per-layer rows: equal lengths?
            lengths = self._lengths()
            if not lengths or any(x != lengths[0] for x in lengths):
                return False
        elif not m.shape[0]:                                            # one (L, T) matrix: equal by construction
            return False
        if self.pending and all(self._matrix(name, pay=False) is not None for name in self._data):
            self._owed += n
            return True
        for name in list(self._data):
            self._set(name, torch.nn.functional.pad(self._stack(name), (0, n)))
        return True

    def keep(self, keeps: Sequence[torch.Tensor | None]) -> None:
        """Layer ``i`` keeps its columns ``keeps[i]`` (slots, in order; None: unchanged)."""
        self._no_pending("keep")
        lengths = self._lengths()
        if keeps and all(k is not None for k in keeps) and len({int(k.shape[0]) for k in keeps}) == 1 \
                and len(set(lengths)) == 1 and len(keeps) == len(lengths):
            idx = torch.stack(list(keeps)).to(self.device)                                # (L, m): one gather
            for name in list(self._data):
                self._set(name, self._stack(name).gather(1, idx))
            return
        for i, keep in enumerate(keeps):
            if keep is not None:
                idx = keep.to(self.device)
                for ts in self.data.values():
                    ts[i] = ts[i].index_select(0, idx)

    def remap(self, idx: Sequence[int]) -> None:
        """Stats for a new slot order on every layer: ``idx[s]`` = old slot, or -1 for a new entry (zeros)."""
        self._no_pending("remap")
        src = torch.tensor([max(i, 0) for i in idx], dtype=torch.long, device=self.device)
        new = torch.tensor([i < 0 for i in idx], dtype=torch.bool, device=self.device)
        self.data = {k: [t[src].masked_fill(new, 0.0) for t in ts] for k, ts in self.data.items()}

    def truncate(self, lengths: Sequence[int]) -> None:
        self.data = {k: [t[:n] for t, n in zip(ts, lengths)] for k, ts in self.data.items()}

    def per_layer(self, matrix: bool = False) -> dict[str, tuple[torch.Tensor, ...] | torch.Tensor]:
        """``{name: (t_0, …, t_{L-1})}`` (the tensors themselves; read only). ``matrix``: a statistic whose
        layers are the rows of one ``(L, T)`` matrix (a stacked update made them) comes as that matrix."""
        if not matrix:
            return {k: tuple(ts) for k, ts in self.data.items()}
        out = {}
        for k in list(self._data):
            m = self._matrix(k)
            out[k] = m if m is not None else tuple(self.data[k])
        return out

    def stacked(self) -> dict[str, torch.Tensor]:
        """``{"acc": (L, T), "ema": (L, T), "count": (T,)}`` (and ``"low": (L, T)`` when ``below``) — a
        uniform cache's statistics as matrices (ValueError if the layers hold different numbers of entries)."""
        lengths = {t.shape[0] for t in self.data["acc"]}
        if len(lengths) > 1:
            raise ValueError("attention statistics differ in length per layer (per-layer live sets); read them "
                             "per layer (KVCache.layer_attn)")
        if not self.data["acc"]:
            return {k: torch.zeros(0) if k == "count" else torch.zeros(0, 0) for k in self.names}
        return {k: self.data[k][0] if k == "count" else torch.stack(self.data[k]) for k in self.names}


def keep_rows(stats: Sequence[AttnStats], keep: torch.Tensor) -> None:
    """:meth:`AttnStats.keep` of several caches' statistics at once: ``stats[r]`` keeps its columns ``keep[r]``
    (``(R, L, m)``, every layer's slots, in order). When every statistic of every cache is one ``(L, n)`` matrix
    of the same shape (a batch's rows, each updated for all layers at once), one gather per statistic for all of
    them; otherwise cache by cache. The same numbers either way."""
    for st in stats:
        st._no_pending("keep")
    names = list(stats[0]._data)
    R, L, m = keep.shape
    if all(list(st._data) == names for st in stats):
        mats = [[st._matrix(name) for st in stats] for name in names]
        shapes = {tuple(x.shape) if x is not None else None for ms in mats for x in ms}
        if len(shapes) == 1 and None not in shapes and next(iter(shapes))[0] == L:
            idx = keep.to(stats[0].device)
            for name, ms in zip(names, mats):
                got = torch.stack(ms).gather(2, idx)                                      # (R, L, m)
                for st, g in zip(stats, got.unbind(0)):
                    st._set(name, g)
            return
    for st, k in zip(stats, keep.unbind(0)):
        st.keep(list(k.unbind(0)))


def lifetime_increment(t: int, n: int, window: int | None) -> torch.Tensor:
    """``(t,)``: how many of a forward's measured queries see each entry — the last ``n`` of the
    ``t`` entries are the forward's own tokens (causal: new token ``i`` is seen by ``n - i``
    queries), only the last ``window`` queries are measured (``None``: all)."""
    w = n if window is None else min(window, n)
    inc = torch.full((t,), float(w))
    inc[t - n:] = torch.clamp(torch.arange(n, 0, -1, dtype=torch.float32), max=float(w))
    return inc


def max_pool_next(mass: torch.Tensor, pool: int) -> torch.Tensor:
    """``(L, T)`` → ``(L, T)``: ``out_j = max(mass_j … mass_{j+pool-1})`` (the window is cut at the end)."""
    if pool <= 1 or mass.shape[-1] == 0:
        return mass
    padded = torch.nn.functional.pad(mass.unsqueeze(1), (0, pool - 1), value=float("-inf"))  # (L, 1, T+pool-1)
    return torch.nn.functional.max_pool1d(padded, pool, stride=1).squeeze(1)
