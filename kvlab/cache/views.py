"""Read-only views of a :class:`~kvlab.cache.kvcache.KVCache`: its mirror (ledger, live maps, events),
its sizes (lengths, bytes), read-only copies of its K/V, the invariant checks and its attention statistics.

:class:`CacheViews` is a mixin that :class:`~kvlab.cache.kvcache.KVCache` inherits; it reads the cache's
parts (``_store``: :class:`~kvlab.cache.storage.Storage`, ``_mirror``: :class:`~kvlab.cache.mirror.Mirror`,
``_stats``: :class:`~kvlab.cache.stats.AttnStats` or None), which ``KVCache`` sets, and changes none of them.
Every edit lives in ``KVCache`` and its operation modules.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvlab.cache.ledger import EventLog, Ledger, Row


class CacheViews:
    """What a :class:`~kvlab.cache.kvcache.KVCache` holds, read only (the mixin it inherits)."""

    # ------------------------------------------------------------------ the mirror

    @property
    def ledger(self) -> Ledger:
        return self._mirror.ledger

    @property
    def live(self) -> list[int]:
        """``slot -> ledger row`` of the live entries, in slot order."""
        return self._mirror.live

    @property
    def events(self) -> EventLog:
        """Append-only edit history: surgery ticks and evictions (see :meth:`ledger_status`)."""
        return self._mirror.events

    @property
    def ticks(self) -> int:
        """Edit ticks attempted (surgery and eviction)."""
        return self._mirror.ticks

    @property
    def token_ids(self) -> list[int]:
        return self._mirror.token_ids

    @property
    def positions(self) -> list[int]:
        return self._mirror.positions

    @property
    def writers(self) -> list[str]:
        return self._mirror.writers

    def layer_positions(self) -> tuple[tuple[int, ...], ...]:
        """Per layer, the absolute position of each live slot."""
        return self._mirror.layer_positions()

    def live_positions(self) -> tuple:
        """:meth:`layer_positions` as read-only sequences gathered only when read whole (``len`` and slices are
        free): what an eviction policy's view carries."""
        return self._mirror.live_positions()

    @property
    def lives(self) -> list[list[int]]:
        """Per layer, ``slot -> ledger row`` (``lives[0]`` is :attr:`live`); read only."""
        return self._mirror.lives

    @property
    def uniform(self) -> bool:
        """Every layer holds the same entries (no per-layer eviction has split them)."""
        return self._mirror.uniform

    def held(self, positions: Sequence[int]) -> list[int]:
        """Those of ``positions`` that some layer holds (a refresh splices them, per layer)."""
        return self._mirror.held(positions)

    def rows(self) -> list[Row]:
        """Ledger rows of the live entries, in slot order."""
        return self._mirror.rows()

    def to_frame(self):
        """The live map as a DataFrame: slot, ledger row, token id, position, writer, step."""
        return self._mirror.to_frame()

    def ledger_status(self) -> list[str]:
        """Status of every ledger row, derived (rows are never edited): ``live`` if in the live map,
        else its last removal event (``deleted``/``replaced``/``superseded``), else ``dropped``."""
        return self._mirror.ledger_status()

    def ledger_frame(self):
        """The whole ledger as a DataFrame with a derived ``status`` and the ``origin`` event of each row."""
        return self._mirror.ledger_frame()

    def slots_at(self, positions: Sequence[int]) -> dict[int, int]:
        """``{position: slot}`` for those of ``positions`` that exactly one live slot holds (evicted
        ones are absent; so are positions an interior insert made ambiguous, which position-addressed
        edits refuse)."""
        return self._mirror.slots_at(positions)

    # ------------------------------------------------------------------ storage

    def __len__(self) -> int:
        return len(self._mirror.live)

    @property
    def num_layers(self) -> int:
        return self._store.num_layers

    def layer_lengths(self) -> list[int]:
        return self._store.layer_lengths()

    @property
    def n_int8(self) -> int:
        """Entries (the oldest slots, same on every layer) held in INT8 storage."""
        return self._store.n_int8

    def nbytes(self) -> int:
        """Real bytes of K/V storage over all layers: the FP tensors at their dtype plus the INT8
        entries with their scales and group ids (:mod:`.int8`). Attention statistics are not K/V
        (see :meth:`meta_nbytes`)."""
        return self._store.nbytes()

    def nbytes16(self) -> int:
        """:meth:`nbytes` at the 16-bit reference (FP entries at 2 bytes per element, INT8 entries at 1
        byte with 16-bit scales): the memory the paper reports, whatever dtype this device stores."""
        return self._store.nbytes16()

    def forward_nbytes(self) -> int:
        """Bytes of K/V held while a forward runs: :meth:`nbytes` plus the full-precision copy of the
        INT8 prefix that each forward materializes, each layer its own INT8 length (equal to
        :meth:`nbytes` without INT8 entries)."""
        store = self._store
        if not store.int8:                                              # no INT8 storage (the hot path)
            return self.nbytes()
        nq = sum(store.int8_len(i) for i in range(store.num_layers))   # INT8 entries over all layers
        if not nq:
            return self.nbytes()
        buf = store.hf.layers[0].buf_k
        _, h, _, d = buf.shape  # (B, H_kv, cap, D)
        return self.nbytes() + nq * 2 * h * d * buf.element_size()

    def meta_nbytes(self) -> int:
        """Bytes of the per-entry attention statistics kept for eviction policies."""
        return self._stats.nbytes() if self._stats is not None else 0

    def geometry(self) -> dict:
        """Layers, KV heads, head dim, dtype of the stored tensors (empty dict before the first write)."""
        return self._store.geometry() if len(self) else {}

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only copies of one layer's (keys, values), each (B, H_kv, T, D), for analysis
        (INT8 entries dequantized)."""
        k, v = self._store.full_kv(layer)
        return k.detach().clone(), v.detach().clone()

    def check(self) -> None:
        """The invariant: layer ``i``'s storage holds exactly ``len(lives[i])`` entries, batch 1, live
        rows valid, attention statistics one column per live entry of each layer."""
        lengths = [len(x) for x in self._mirror.lives]
        self._store.check(lengths)
        self._mirror.check()
        if self._stats is not None and self.num_layers:
            self._stats.check(lengths)

    def check_lengths(self) -> None:
        """The per-step part of :meth:`check` (O(layers)): storage and statistics lengths match the
        live maps, batch 1."""
        lengths = [len(x) for x in self._mirror.lives]
        self._store.check(lengths)
        if self._stats is not None and self.num_layers:
            self._stats.check(lengths)

    def __repr__(self) -> str:
        from collections import Counter

        return (f"KVCache(len={len(self)}, layers={self.num_layers}, next_position={self.next_position}, "
                f"writers={dict(Counter(self.writers))}, ledger_rows={len(self.ledger)})")

    # ------------------------------------------------------------------ attention statistics

    @property
    def attn(self) -> dict[str, torch.Tensor] | None:
        """Per-entry attention statistics of a uniform cache as matrices (None unless
        :meth:`track_attention` ran): ``acc`` / ``ema`` (L, T), ``count`` (T,). Per-layer live sets:
        :meth:`layer_attn`."""
        return self._stats.stacked() if self._stats is not None else None

    @property
    def ema_decay(self) -> float | None:
        return self._stats.ema_decay if self._stats is not None else None

    @property
    def attn_window(self) -> int | None:
        return self._stats.window if self._stats is not None else None

    @property
    def attn_pool(self) -> int:
        return self._stats.pool if self._stats is not None else 1

    def layer_attn(self, matrix: bool = False) -> dict[str, tuple[torch.Tensor, ...] | torch.Tensor] | None:
        """The attention statistics per layer (None when not tracked): ``{name: (t_0, …, t_{L-1})}``,
        ``t_l`` of shape ``(T_l,)`` over layer ``l``'s live slots (views; read only), as
        :class:`~kvlab.eviction.base.EvictView` carries them. ``matrix``: a statistic held as one ``(L, T)``
        matrix (every layer as long) comes as it (row ``l`` = ``t_l``; what the eviction phase's view carries)."""
        self._settle()
        return self._stats.per_layer(matrix) if self._stats is not None else None

    def attention_stats(self) -> dict[str, torch.Tensor] | None:
        """Copies of the attention statistics (None when not tracked), for policies."""
        return None if self.attn is None else {k: t.detach().clone() for k, t in self.attn.items()}
