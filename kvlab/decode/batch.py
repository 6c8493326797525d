"""Batched decoding: B prompts in lock-step, one batched decoder forward per step, every other phase per row
(:class:`BatchDecoding`, :func:`run_batch`)."""
from __future__ import annotations

import time
from typing import Iterator

from kvlab.cache.deferred import settle_rows
from kvlab.cache.inputs import capture_rows
from kvlab.core.compat import IncompatiblePairError
from kvlab.decode.config import DecodeConfig
from kvlab.decode.protocols import evict_attr, keep_rows, refresh_attr
from kvlab.decode.loop import Decoding, _trace
from kvlab.decode.records import StepRecord, Trace
from kvlab.decode.refresh_phase import _sync
from kvlab.decode.sampling import token_stats_rows


class BatchError(RuntimeError):
    """Some rows of a batch failed: ``errors`` ``{row: exception}``; ``traces`` holds the other rows'
    finished :class:`Trace` s (None for the failed ones)."""

    def __init__(self, errors: dict, traces: list):
        self.errors, self.traces = errors, traces
        msg = "; ".join(f"row {b}: {type(e).__name__}: {e}" for b, e in sorted(errors.items()))
        super().__init__(f"{len(errors)} of {len(traces)} rows failed ({msg})")


class BatchDecoding:
    """B generations in lock-step: one batched decoder forward per step, everything else per row.

    Each row is a :class:`Decoding` (its own prompt, config, RNG stream seeded from its own
    sampling seed, refresh frontier and schedule, eviction policy state, records) whose decoding
    cache is row ``b`` of shared batch buffers (:class:`kvlab.cache.batch.Bank`: a row is an
    ordinary KVCache with its own ledger, live maps and per-layer lengths, edited in place). A step:

    * **advance** — every row that needs its decoder's forward on ``y_{t-1}`` gets it from ONE
      batched forward (:func:`kvlab.cache.batch.forward_rows`); a row holding a refresh's pending
      logits skips it (it rides along as a masked dummy, as do finished rows);
    * **score, probe, refresh, evict** — :meth:`Decoding._phases`, per row (teacher forwards of probes and
      refreshes run per row on the row's own teacher cache), except the eviction decision: the rows sharing a
      policy decide together (:meth:`_decide`, ``keep_rows``: one ranking for all of them, the same decisions),
      then each row's cache applies its own.

    * **prefill** — the rows' prompts in ONE batched forward (different lengths: padded, the padding
      never committed; :meth:`_prefill_rows`), except a row that measures attention mass during its
      prefill or resumes a cache: it prefills on its own.

    Rows that stop early (EOS,
    ``ignore_eos=False``) drop out; the others go on. A row whose phases raise is dropped and its
    error kept in ``errors``; the other rows finish. Iterating yields ``(row, StepRecord)``.

    A row's tokens do not depend on its batch: its RNG, policies and probes see only its own state;
    the batched forward's logits equal the row's single forward to float tolerance (different
    matmul shapes; tests/test_batch_decode.py states it).
    """

    def __init__(self, teacher, student, prompts, config: DecodeConfig | list | tuple | None = None, **overrides):
        if isinstance(prompts, str) or not hasattr(prompts, "__len__") or not len(prompts):
            raise ValueError("prompts must be a non-empty list of prompt strings")
        configs = list(config) if isinstance(config, (list, tuple)) else [config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError(f"config has {len(configs)} entries for {len(prompts)} prompts (give one, or one per row)")
        rows = []
        for b, (p, c) in enumerate(zip(prompts, configs)):
            if isinstance(p, str) and not p.strip():
                raise ValueError(f"row {b}: prompts[{b}] is empty; every row needs a non-empty prompt")
            try:
                rows.append(Decoding(teacher, student, p, c, **overrides))
            except IncompatiblePairError:
                raise
            except ValueError as e:
                raise ValueError(f"row {b}: {e}") from e
        modes = {d.config.mode for d in rows}
        if len(modes) > 1:
            b = next(i for i, d in enumerate(rows) if d.config.mode != rows[0].config.mode)
            raise ValueError(f"row {b}: mode={rows[b].config.mode!r} differs from row 0's {rows[0].config.mode!r}; "
                             "one batch runs one decoder (split the batch by mode)")
        first = rows[0]
        devices = {str(m.device) for m in (teacher, student) if m is not None
                   and (m is first.decoder or m is first.prefiller or first.config.mode == "overfill")}
        if len(devices) > 1:
            raise ValueError(f"teacher and student are on different devices ({sorted(devices)}); a batch runs on one "
                             "device: move both models there (load_pair(device=...))")
        ctx = getattr(first.decoder.model.config, "max_position_embeddings", None)
        for b, d in enumerate(rows):
            if ctx is not None and len(d.prompt_ids) >= ctx:
                raise ValueError(f"row {b}: prompt has {len(d.prompt_ids)} tokens, the model's context is {ctx} "
                                 f"(max_position_embeddings); shorten prompts[{b}]")
            for name in ("refresh", "evict"):
                pol = getattr(d.config, name)
                if pol is not None and (evict_attr(pol, "batchable") if name == "evict" else refresh_attr(pol, "batchable")) is False:
                    raise ValueError(f"row {b}: {name}={type(pol).__name__} cannot run batched (batchable=False); "
                                     "run it with batch 1")
        self.rows = rows
        self.errors: dict[int, BaseException] = {}
        self.bank = self.teacher_bank = None
        self.catch_up_errors: list[BaseException] = []   # batched teacher catch-ups that fell back to per-row
        self.prefill_errors: list[BaseException] = []    # a batched prefill that fell back to per-row
        self._it = None

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[tuple[int, StepRecord]]:
        if self._it is None:
            self._it = self._steps()
        return self._it

    def __next__(self) -> tuple[int, StepRecord]:
        return next(iter(self))

    def _fail(self, b: int, e: BaseException, live: set) -> None:
        self.errors[b] = e
        live.discard(b)

    def _steps(self) -> Iterator[tuple[int, StepRecord]]:
        from kvlab.cache.batch import Bank

        rows = self.rows
        B = len(rows)
        first = rows[0]
        dec = first.decoder
        cap = max(len(d.prompt_ids) + d.config.max_new_tokens for d in rows) + 2
        self.bank = Bank.for_model(dec.model, B, capacity=cap)
        if first.config.mode == "overfill":             # the teachers' own caches: rows of a second bank
            self.teacher_bank = Bank.for_model(first.teacher.model, B, capacity=cap)
        for b, d in enumerate(rows):
            d._bank, d._tbank, d._row = self.bank, self.teacher_bank, b
        live = set(range(B))
        step_of = [d.first_step for d in rows]
        prefilled, shared = self._prefill_rows()
        for b, d in enumerate(rows):                    # step 1 (and any prefill not batched), per row
            t0 = time.perf_counter() - (shared if b in prefilled else 0.0)
            try:
                rec = d._phases(d.first_step, d._begin(prefilled.get(b)), d.prefill_name, t0)
            except Exception as e:                      # noqa: BLE001 - kept per row, re-raised by run_batch
                self._fail(b, e, live)
                continue
            yield b, rec
            if d._stops(rec):
                live.discard(b)
            step_of[b] += 1
        self.slot = list(range(B))                      # row -> its bank slot (rows move when others finish)
        self._compact(live)
        while live:
            yield from self._step(sorted(live), step_of, live)
            self._compact(live)

    def _compact(self, live: set) -> None:
        """Finished (and failed) rows leave the batched forwards: each is swapped with the last live row
        of the banks' width (:meth:`~kvlab.cache.bank.Bank.swap`: both caches keep their content), and the
        width shrinks to the live rows. The teacher bank (overfill) moves in lock-step."""
        banks = [bk for bk in (self.bank, self.teacher_bank) if bk is not None]
        row_at = {s: b for b, s in enumerate(self.slot)}
        width = self.bank.width
        s = 0
        while s < width:
            if row_at[s] in live:
                s += 1
                continue
            last = width - 1
            while last > s and row_at[last] not in live:
                last -= 1
            if last > s:                                 # a live row moves into the finished row's slot
                for bk in banks:
                    bk.swap(s, last)
                a, b = row_at[s], row_at[last]
                row_at[s], row_at[last] = b, a
                self.slot[a], self.slot[b] = last, s
            width = last if last > s else s
        for bk in banks:
            bk.set_width(max(width, 1))

    def _prefill_rows(self) -> tuple[dict, float]:
        """Prefill the rows that allow it (:meth:`Decoding._batch_prefill`) in ONE batched forward of
        their prompts (different lengths: padded, the padding never committed). Returns ``{row:
        (cache, logits)}`` and the forward's time. With fewer than two such rows, or if the forward
        fails (nothing committed: :func:`~kvlab.cache.batch.forward_rows` is all-or-nothing; the error
        goes to ``prefill_errors``), every row prefills on its own in :meth:`Decoding._start`."""
        from kvlab.cache.batch import forward_rows

        rows, B = self.rows, len(self.rows)
        first = rows[0]
        caches = [d._batch_prefill() for d in rows]
        todo = [b for b in range(B) if caches[b] is not None]
        if len(todo) < 2:
            return {}, 0.0
        bank = self.teacher_bank if first.config.mode == "overfill" else self.bank
        t0 = time.perf_counter()
        try:
            logits = forward_rows(bank, first.prefiller.model, caches,
                                  [rows[b].prompt_ids if caches[b] is not None else None for b in range(B)],
                                  writer=first.prefill_name, steps=[-1] * B)                  # (B, V)
        except Exception as e:                          # noqa: BLE001 - rows fall back to their own prefill
            self.prefill_errors.append(e)
            return {}, 0.0
        _sync(first.prefiller.device)
        return {b: (caches[b], logits[b]) for b in todo}, time.perf_counter() - t0

    def _step(self, order: list[int], step_of: list[int], live: set):
        """One lock-step: advance (one batched decoder forward), score per row, one batched teacher
        catch-up for the rows whose probe or refresh is due, then probe/refresh/evict per row."""
        from kvlab.cache.batch import forward_rows

        rows, B, slot = self.rows, len(self.rows), self.slot
        t0 = time.perf_counter()
        need = [b for b in order if rows[b]._pending is None]
        logits = None
        if need:
            dec = rows[0].decoder
            caches, tokens, steps, attention = [None] * B, [None] * B, [0] * B, [False] * B   # per bank slot
            defer = [False] * B
            for b in need:
                s = slot[b]
                caches[s], tokens[s], steps[s] = rows[b].cache, rows[b].tokens[-1], step_of[b] - 1
                measure = rows[b]._measures_at(step_of[b])
                defer[s] = measure and rows[b]._defer_attention  # statistics computed when the policy reads them
                attention[s] = measure and not defer[s]
            with capture_rows({slot[b]: rows[b]._inputs for b in need}, dec.model):
                logits = forward_rows(self.bank, dec.model, caches, tokens, writer=rows[0].decoder_name,
                                      steps=steps, attention=attention, defer=defer)  # (width, V) per slot
            _sync(dec.device)
        stats = token_stats_rows(logits) if need else None      # every slot's in one pass (rows in `need`)
        shared = time.perf_counter() - t0
        scored = {}
        for b in order:
            d = rows[b]
            t1 = time.perf_counter()
            if b in need:
                lg, src, st = logits[slot[b]], d.decoder_name, stats[slot[b]]
            else:
                (lg, src), d._pending, st = d._pending, None, None
            d._fwd_bytes = d.cache.forward_nbytes()
            try:
                rec = d._score(step_of[b], lg, src, st)
                d._acc = {"teacher_tokens": 0, "teacher_s": 0.0}
                due = d._teacher_due(rec)
            except Exception as e:                      # noqa: BLE001
                self._fail(b, e, live)
                continue
            scored[b] = (rec, lg, shared + time.perf_counter() - t1, due)
        teacher_s = self._catch_up({b: v[3] for b, v in scored.items() if v[3] is not None})
        ready, views = {}, {}
        settling = [b for b, v in scored.items() if rows[b]._settles_at(v[0].step)]
        t1 = time.perf_counter()
        settle_rows([rows[b].cache for b in settling])  # deferred statistics of the rows asked now, together
        settled = {b: (time.perf_counter() - t1) / len(settling) for b in settling}   # each row's share of it
        for b, (rec, lg, spent, due) in scored.items():  # probe, refresh and the eviction view, per row
            d = rows[b]
            t1 = time.perf_counter()
            try:
                rec = d._before_evict(rec, lg)
                view = d._evict_view(rec, lg)
            except Exception as e:                      # noqa: BLE001
                self._fail(b, e, live)
                continue
            if view is not None:
                views[b] = view
            ready[b] = (rec, spent + settled.get(b, 0.0) + (teacher_s if due is not None else 0.0)
                        + time.perf_counter() - t1)
        decided, share = self._decide(views)            # every row's eviction decided at once, per policy
        views = None                                    # released before the edit: their live maps need no copy
        applied, edit = self._apply_rows(decided)       # and applied at once where the rows' edits fit
        for b, (rec, spent) in ready.items():
            d = rows[b]
            t0 = time.perf_counter() - spent - share.get(b, 0.0) - (edit if b in applied else 0.0)
            try:
                if b in decided:
                    if isinstance(decided[b], BaseException):
                        raise decided[b]
                    if isinstance(applied.get(b), BaseException):
                        raise applied[b]
                    rec = d._apply_evict(rec, decided[b], *((applied[b],) if b in applied else ()))
                rec = d._finish(rec, t0)
            except Exception as e:                      # noqa: BLE001
                self._fail(b, e, live)
                continue
            yield b, rec
            step_of[b] += 1
            if d._stops(rec):
                live.discard(b)

    def _decide(self, views: dict) -> tuple[dict, dict]:
        """The rows' eviction decisions (``{row: view}``): the rows sharing a policy object decided together
        (:func:`~kvlab.decode.protocols.keep_rows`: one ranking for all of them), the same decisions as each
        row's own ``keep``. Returns ``{row: Keep or the exception its decision raised}`` and each row's share
        of the time spent. If a batched decision raises, its rows decide one by one (each keeps its own error)."""
        groups: dict[int, list[int]] = {}
        for b in views:
            groups.setdefault(id(self.rows[b].config.evict), []).append(b)
        decided, share = {}, {}
        for bs in groups.values():
            pol = self.rows[bs[0]].config.evict
            t0 = time.perf_counter()
            try:
                for b, k in zip(bs, keep_rows(pol, [views[b] for b in bs])):
                    decided[b] = k
            except Exception:                           # noqa: BLE001 - row by row: each row its own error
                for b in bs:
                    try:
                        decided[b] = pol.keep(views[b])
                    except Exception as e:              # noqa: BLE001
                        decided[b] = e
            spent = (time.perf_counter() - t0) / len(bs)
            share.update({b: spent for b in bs})
        return decided, share

    def _apply_rows(self, decided: dict) -> tuple[dict, float]:
        """The decided rows' evictions, all at once (:func:`~kvlab.decode.evict_phase.apply_keep_rows`: one edit
        for the rows whose decisions fit it, the same caches as row by row). Returns ``{row: its EvictReport or
        None}`` (or the error the edit raised) and each row's share of the time. Only plain evictions go here (no
        re-rotation, no INT8 demotion: their edits validate every row before changing any); if a row's slots are
        bad (ValueError), nothing changed and each row applies its own decision (and fails on its own)."""
        from kvlab.decode.evict_phase import apply_keep_rows

        bs = [b for b, k in decided.items() if not isinstance(k, BaseException) and not k.rerotate
              and k.int8_window is None]
        if len(bs) < 2:
            return {}, 0.0
        t0 = time.perf_counter()
        try:
            reps = apply_keep_rows([self.rows[b].cache for b in bs], [decided[b] for b in bs],
                                   self.rows[0].decoder.model)
        except ValueError:                              # validation: nothing changed, each row on its own
            return {}, 0.0
        except Exception as e:                          # noqa: BLE001 - the rows' edit failed: each row fails
            reps = [e] * len(bs)
        return dict(zip(bs, reps)), (time.perf_counter() - t0) / len(bs)

    def _catch_up(self, due: dict[int, int]) -> float:
        """Extend the teacher caches of rows ``due`` (``{row: n}``) to ``x, y_≤n`` in one batched
        forward (each row's own missing tokens; rows already there are skipped); the rows' probes and
        refreshes then find their teacher logits ready (``_teacher_upto``), and their tallies get the
        tokens and the forward's time. Returns that time (0 if none ran). If the batched forward
        fails, nothing changed and every row catches up on its own in its phases."""
        from kvlab.cache.batch import forward_rows

        rows, B, slot = self.rows, len(self.rows), self.slot
        todo = {}
        for b, n in due.items():
            d = rows[b]
            have = d.teacher_cache.next_position - len(d.prompt_ids)
            if n > have and n <= len(d.tokens) and self.teacher_bank.owns(slot[b], d.teacher_cache):
                todo[b] = (have, n)
        if not todo:
            return 0.0
        t0 = time.perf_counter()
        teacher = rows[0].teacher
        caches, tokens, steps = [None] * B, [None] * B, [0] * B                          # per bank slot
        for b, (have, n) in todo.items():
            caches[slot[b]], tokens[slot[b]], steps[slot[b]] = rows[b].teacher_cache, rows[b].tokens[have:n], \
                len(rows[b].tokens)
        try:
            logits = forward_rows(self.teacher_bank, teacher.model, caches, tokens, writer="teacher", steps=steps)
        except Exception as e:                          # noqa: BLE001 - rows fall back to their own forwards
            self.catch_up_errors.append(e)
            return 0.0
        _sync(teacher.device)
        spent = time.perf_counter() - t0
        for b, (have, n) in todo.items():
            d = rows[b]
            d._teacher_logits = logits[slot[b]]
            d._acc["teacher_tokens"] += n - have
            d._acc["teacher_s"] += spent
        return spent


def run_batch(teacher, student, prompts, config: DecodeConfig | list | tuple | None = None, *, on_step=None,
              on_row=None, **overrides) -> list[Trace]:
    """Drain a :class:`BatchDecoding` into one :class:`Trace` per row (in prompt order).

    ``on_step(row, record, decoding)`` is called after every row's step; ``on_row(row, trace)`` as
    soon as a row finishes (e.g. to store it). If rows failed, the others still finish (and
    ``on_row`` sees them), then :class:`BatchError` is raised carrying the finished traces."""
    bd = BatchDecoding(teacher, student, prompts, config, **overrides)
    records: list[list[StepRecord]] = [[] for _ in bd.rows]
    traces: list[Trace | None] = [None] * len(bd.rows)
    for b, rec in bd:
        records[b].append(rec)
        if on_step is not None:
            on_step(b, rec, bd.rows[b])
        if bd.rows[b]._stops(rec):
            traces[b] = _trace(bd.rows[b], records[b])
            if on_row is not None:
                on_row(b, traces[b])
    if bd.errors:
        raise BatchError(bd.errors, traces)
    return traces
