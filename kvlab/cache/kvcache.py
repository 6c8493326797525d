"""The KV cache of one sequence: storage and token mirror, edited in lock-step.

A :class:`KVCache` composes

* :class:`~kvlab.cache.storage.Storage` — per-layer K/V tensors ``(B, H_kv, T, D)`` (keys
  post-RoPE), full precision or INT8 (:mod:`.int8`); the only object that touches cache tensors;
* :class:`~kvlab.cache.mirror.Mirror` — the append-only **ledger** (token id, absolute RoPE
  position, writer, decode step of every entry ever written), the **live map** (``slot -> ledger
  row``) and the event log;
* :class:`~kvlab.cache.stats.AttnStats` — per-entry attention statistics for eviction policies
  (when tracked).

The operations over them live in one module each: :mod:`.forward` (prefill / decode step, probe),
:mod:`.splices` (refresh copies between caches, crop), :mod:`.surgery` (seed 004 action ticks),
:mod:`.evict` (eviction, RoPE re-rotation, INT8 demotion); the read-only views (mirror, sizes, checks,
attention statistics) in :mod:`.views`. Every edit changes storage, mirror and statistics in the same call,
and restores them if it fails, so ``len(live) == cache length`` on every layer at all times
(:meth:`KVCache.check`). Nothing outside :mod:`kvlab.cache` reads the tensors: a transformers cache-API
change breaks one file (:mod:`.storage`).

Per-layer live sets. Every layer has its own live map (``lives[i]``); :attr:`KVCache.live`,
``positions``, ``len()`` are layer 0's. Eviction may drop different entries on different layers
(``evict(layers=...)``); refresh splices and copies then work layer by layer over what each layer
still holds. transformers sizes one attention mask from layer 0, so once layers differ in length
the cache switches the model to the ``"kvlab"`` attention function (:mod:`.attn_fn`, registered
through ``AttentionInterface``), which builds each layer's own causal mask. Surgery, ``crop`` and
re-rotation address slots shared by all layers and refuse a cache whose layers differ.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from transformers.cache_utils import DynamicCache

from kvlab.cache import deferred as _deferred
from kvlab.cache import evict as _evict
from kvlab.cache import forward as _forward
from kvlab.cache import splices as _splices
from kvlab.cache import surgery as _surgery
from kvlab.cache.evict import EvictReport
from kvlab.cache.ledger import Ledger
from kvlab.cache.mirror import Mirror
from kvlab.cache.plan import TickReport
from kvlab.cache.stats import EMA_PREFILL, AttnStats
from kvlab.cache.storage import BufferLayer, KVStore, Storage
from kvlab.cache.views import CacheViews


class KVCache(CacheViews):
    """Storage plus ledger and live map, edited in lock-step (batch 1, one sequence).

    ``next_position`` is the RoPE position the next appended token gets. It is owned here and by
    the decode loop, never inferred from the cache length. The read-only views (ledger, live maps,
    sizes, ``kv``, ``check``, attention statistics) come from :class:`~kvlab.cache.views.CacheViews`;
    every edit is a method here.
    """

    def __init__(self, hf: DynamicCache | None = None, ledger: Ledger | None = None,
                 live: list[int] | None = None, next_position: int = 0):
        if hf is not None and not isinstance(hf, KVStore):     # a transformers cache: copy into buffers
            hf = KVStore([BufferLayer.of(lay.keys, lay.values) for lay in hf.layers])
        self._store = Storage(hf)
        self._mirror = Mirror(ledger, live)
        self._mirror.set_layers(self._store.num_layers)
        self._stats: AttnStats | None = None
        self.next_position = int(next_position)
        self.check()

    @torch.inference_mode()
    def copy(self) -> "KVCache":
        """A deep copy: new tensors, new ledger, new live map."""
        self._settle()
        new = KVCache.__new__(KVCache)
        new._store = self._store.copy()
        new._mirror = self._mirror.copy()
        new._stats = self._stats.copy() if self._stats is not None else None
        new.next_position = self.next_position
        new.check()
        return new

    def _settle(self) -> None:
        """Fold deferred queries into the attention statistics (:mod:`.deferred`): every edit and every read of the
        statistics starts here, so they are always as if each step had been measured."""
        if self._stats is not None and self._stats.pending:
            _deferred.settle(self)

    # ------------------------------------------------------------------ attention statistics

    def track_attention(self, ema_decay: float = 0.9, *, window: int | None = None, pool: int = 1,
                        below: bool = False, ema_prefill: str = "query") -> None:
        """Start keeping per-entry attention statistics, updated by every
        ``forward(..., attention=True)`` and carried through every edit, per layer over its own live
        slots (:meth:`layer_attn`; :attr:`attn` stacks a uniform cache's to ``(L, T)``):

        * ``acc``: accumulated mass ``Σ_steps mass`` (H2O),
        * ``ema``: ``ema ← β·ema + (1-β)·a_i`` with ``β = ema_decay`` (Conf-KV), one update per measured
          query ``a_i`` in query order (``ema_prefill="query"``, the default; a multi-token forward
          such as the prefill is ``w`` updates, its last queries weigh most) or, ``ema_prefill="sum"``,
          one update with the forward's summed mass (kvlab's earlier convention),
        * ``count``: the entry's lifetime in measured queries — how many measured queries could
          attend to it (NORM_SUM's denominator, as OpenVINO GenAI counts it: a prefill of L tokens
          registers L, L-1, …, 1; each decode step adds 1 to every entry).

        ``window`` (SnapKV's observation window, seed 003 ``snapkv_window_size``): only the last
        ``window`` queries of a multi-token forward contribute mass (and count); ``None`` = all.
        ``pool``: each forward's mass is max-pooled over the entry and the ``pool - 1`` entries after
        it (``mass_j ← max(mass_j … mass_{j+pool-1})``, OpenVINO's ``_max_pool``) before it is folded in.
        ``below=True`` also keeps ``low``: how many measured queries gave the entry less
        than the uniform share ``1/T_i`` of their head-mean attention (Scissorhands).

        Entries present before tracking starts, or written by a forward without
        ``attention=True``, start at 0. Idempotent for the same settings."""
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay={ema_decay!r} must be in [0, 1)")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r} must be None (every query) or an int >= 1 (the last queries)")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"pool={pool!r} must be an int >= 1 (1: no pooling)")
        if not isinstance(below, bool):
            raise ValueError(f"below={below!r} must be True or False")
        if ema_prefill not in EMA_PREFILL:
            raise ValueError(f"ema_prefill={ema_prefill!r} must be one of {EMA_PREFILL}")
        s = self._stats
        if s is not None:
            if (s.ema_decay, s.window, s.pool, s.below, s.ema_prefill) != (float(ema_decay), window, pool, below,
                                                                             ema_prefill):
                raise ValueError(f"attention is already tracked with ema_decay={s.ema_decay}, "
                                 f"window={s.window}, pool={s.pool}, below={s.below}, ema_prefill={s.ema_prefill}")
            return
        dev = self._store.device if self.num_layers else torch.device("cpu")
        self._stats = AttnStats(ema_decay, self.layer_lengths(), dev, window, pool, below, ema_prefill)

    # ------------------------------------------------------------------ forwards (.forward)

    def forward(self, model, token_ids: Sequence[int] | torch.Tensor, *, writer: str, step: int = -1,
                positions: Sequence[int] | None = None, logits: str = "last", attention: bool = False) -> torch.Tensor:
        """Run ``model`` on ``token_ids`` over this cache, appending their K/V (prefill or decode step).

        Positions default to ``next_position, next_position+1, …`` and are passed explicitly as
        ``position_ids``. Returns logits ``(n, V)`` for ``logits="all"`` or ``(V,)`` for ``"last"``.
        On error the cache and ledger are rolled back to their state before the call.

        ``attention=True`` (needs :meth:`track_attention` first) also measures this forward's
        attention mass over every entry (the ``"kvlab"`` attention function computes it with the
        layer's output and hands it to a :class:`~kvlab.cache.mass.MassSink`: no hooks, no second pass) and folds it into :attr:`attn`. INT8 entries are dequantized into the
        ``DynamicCache`` for the duration of the forward and dropped again afterwards.
        """
        self._settle()
        return _forward.forward(self, model, token_ids, writer=writer, step=step, positions=positions,
                                logits=logits, attention=attention)

    def probe_last(self, model, n_copies: int) -> torch.Tensor:
        """Re-run the last live entry as a batch of ``n_copies`` over the other entries; ``(n, V)`` logits.

        The last entry's token is fed again at its ledger position, attending to the first
        ``len - 1`` entries — the computation that produced the current step's logits — with the
        batch dimension expanded to ``n_copies`` (e.g. N Monte-Carlo-dropout passes in one
        forward). This cache is NOT modified: the batch runs on a throwaway ``DynamicCache``
        whose layers are ``expand`` views of this cache's prefix (no copy until the model's own
        append concatenates the new entry); the N new K/V entries die with it. Tensors, ledger,
        live map and ``next_position`` are bit-identical before and after.
        """
        return _forward.probe_last(self, model, n_copies)

    @classmethod
    def prefill(cls, model, token_ids, *, writer: str, logits: str = "last"):
        """A new cache holding ``token_ids`` at positions 0..n-1; returns ``(cache, logits)``."""
        cache = cls()
        out = cache.forward(model, token_ids, writer=writer, step=-1, logits=logits)
        return cache, out

    # ------------------------------------------------------------------ copies between caches (.splices)

    def splice_last(self, src: "KVCache", k: int) -> list[int]:
        """Overwrite this cache's last ``k`` entries with ``src``'s last ``k``, on every layer.

        Both caches must hold the same tokens at the same positions there (checked before any
        tensor is touched). The ledger gains ``k`` rows carrying ``src``'s writer and step, and
        the live map points at them. Returns the slots rewritten.
        """
        self._settle()
        return _splices.splice_last(self, src, k)

    def splice_positions(self, src: "KVCache", positions: Sequence[int]) -> list[int]:
        """Overwrite this cache's entries at absolute ``positions`` with ``src``'s entries there.

        Unlike :meth:`splice_last` the caches may end at different points (a refresh splices
        from a teacher cache that is one entry ahead). Both must hold each position with the same
        token (checked before any tensor is touched). The ledger gains one row per position with
        ``src``'s writer and step. Returns the slots rewritten.
        """
        self._settle()
        return _splices.splice_positions(self, src, positions)

    def append_from(self, src: "KVCache", n: int) -> list[int]:
        """Append ``src``'s entries at positions ``next_position .. next_position + n - 1``.

        The K/V are copied (not recomputed); the ledger rows carry ``src``'s writer, token and
        step, and ``next_position`` advances by ``n``. Returns the new slots.
        """
        self._settle()
        return _splices.append_from(self, src, n)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` entries (``n >= 0``); ``next_position`` is unchanged."""
        self._settle()
        _splices.crop(self, n)

    # ------------------------------------------------------------------ surgery (.surgery, seed 004)

    def apply(self, actions: Sequence[Mapping], model, *, writer: str, step: int = -1,
              splice: str = "gather", fault_hook: Callable[[str], None] | None = None,
              rerotate: bool = False) -> TickReport:
        """Execute an action list (``delete``, ``insert``, ``replace_pair``, ``add``) as one tick;
        tensors and live map are cut by the same layout, all-or-nothing. Semantics (positions,
        ``rerotate``, failure and rebuild, ``fault_hook``): :func:`kvlab.cache.surgery.apply`."""
        self._settle()
        return _surgery.apply(self, actions, model, writer=writer, step=step, splice=splice,
                              fault_hook=fault_hook, rerotate=rerotate)

    def delete(self, pos: int, model, *, writer: str, step: int = -1) -> TickReport:
        """Drop slot ``pos`` (one-action tick; ``model`` is needed only to rebuild on failure)."""
        return self.apply([{"action": "delete", "pos": pos}], model, writer=writer, step=step)

    def insert(self, pos: int, token_ids: Sequence[int], model, *, writer: str, step: int = -1) -> TickReport:
        """Insert ``token_ids`` right before slot ``pos``, K/V computed over slots ``[0, pos)``."""
        return self.apply([{"action": "insert", "pos": pos, "token_ids": list(token_ids)}], model,
                          writer=writer, step=step)

    def append(self, token_id: int, model, *, writer: str, step: int = -1) -> TickReport:
        """Append one token at ``next_position`` (same K/V as a decode step)."""
        return self.apply([{"action": "add", "token_id": token_id}], model, writer=writer, step=step)

    # ------------------------------------------------------------------ eviction, re-rotation, INT8 (.evict)

    def evict(self, slots: Sequence[int], *, model=None, rerotate: bool = False,
              layers: Sequence[Sequence[int]] | None = None) -> EvictReport:
        """Remove the entries at ``slots`` (of each layer's own live list) from every layer, the live
        maps and the attention statistics, in one call; log ``evicted`` for their ledger rows.
        ``layers`` (one slot list per layer) removes per layer instead (``slots`` is then ignored):
        afterwards layers may hold different entries and lengths (per-layer live sets; the model
        then runs the ``"kvlab"`` attention function, :mod:`.attn_fn`). Compaction is in place in
        each layer's buffer (:class:`~kvlab.cache.storage.BufferLayer`).

        Survivors keep their absolute positions (the decode loop passes explicit
        ``position_ids``, so RoPE distances stay right) unless ``rerotate=True`` (needs
        ``model`` for its RoPE): then survivors move to consecutive positions from the first
        slot's position on (:meth:`reposition`), like seed 003's ``apply_rotation``, and
        ``next_position`` becomes the last position + 1 — on every layer, each its own survivors
        (per-layer drops must leave every layer the same number of entries from the same first
        position, so the next query's position fits all of them; ValueError otherwise).
        Validation (ints, distinct, in range, per layer) happens before any tensor is touched.
        """
        self._settle()
        return _evict.evict(self, slots, model=model, rerotate=rerotate, layers=layers)

    def reposition(self, model, positions: Sequence[int]) -> int:
        """Move every live entry to ``positions`` (one per slot) by rotating its post-RoPE key by
        ``new - old`` (:mod:`.rope`, the model's rotary config). Values are untouched. Moved entries
        get new ledger rows (token, writer, step copied; new position) and events ``moved``; the
        old rows' status becomes ``moved``. ``next_position`` becomes ``max(positions) + 1``.
        Returns how many entries moved. Positions must be distinct ints."""
        self._settle()
        return _evict.reposition(self, model, positions)

    def quantize_older(self, window: int, group: int | None = 64) -> int:
        """Move every FP entry older than the newest ``window`` entries to INT8 (:mod:`.int8`),
        once at least ``group`` of them are waiting (they form one scale group); ``group=None``: every
        step, into one scale per (head, channel) over the whole INT8 prefix (the paper's). Returns
        how many entries were quantized (0 if fewer than ``group`` wait)."""
        self._settle()
        return _evict.quantize_older(self, window, group)

    @torch.inference_mode()
    def dequantize(self) -> None:
        """Turn every INT8 entry back into an FP entry (values as dequantized)."""
        self._settle()
        self._store.dequantize()
        self.check()
