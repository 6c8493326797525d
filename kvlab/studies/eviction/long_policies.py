"""The policies of the long-context eviction study (issue 36, ``evict-long``), at the Conf-KV paper's budgets.
Pure data: builds policies through the registry (:data:`kvlab.eviction.EVICTION_POLICIES`), runs nothing. Row
names are ``<family>_b<budget>`` (``sliding_b256``, ``h2o_b512``, ...); the retrieval study can build the same
rows with :func:`long_policies`.

Each family at budget ``B`` entries (mean live length about ``B``):

* ``sliding``: 4 sinks + the newest ``B - 4`` entries at their original positions (kvlab's window);
* ``streamingllm``: the same entries, re-rotated to positions inside the cache (StreamingLLM as published);
* ``h2o``: half heavy hitters, half recent (``recent = B // 2``, no sinks: H2O's paper);
* ``scissorhands``: the registry's setup (``recent = B // 4``) with 4 sinks;
* ``snapkv`` / ``pyramidkv``: the prompt cut once to ``B - tokens // 2`` entries (PyramidKV: per layer on average,
  the same total) with a 32-query observation window, then every step appends: mean length about ``B`` over a
  ``tokens``-step continuation; PyramidKV is the pyramid, SnapKV its uniform counterpart;
* ``block``: OpenVINO's block eviction, blocks of 16, at most ``B`` entries;
* ``confkv_l``: Conf-KV-L as the paper runs it (pyramidal per-layer budgets, INT8 storage of all but the newest
  ``protect = 32`` entries, 4 sinks): ``loose = B``, ``tight = B - gap``; ``gap`` and ``gamma`` set how often the
  cache stands at the loose budget (``frac_at_loose``);
* ``confkv_int8``: the same schedule and storage on uniform budgets (Conf-KV-L's equal-memory uniform twin);
* ``confkv_l_fixed``: the confidence-off control, Conf-KV-L's ranker and storage at ONE fixed budget equal to
  Conf-KV-L's mean live length on the same prompt (:func:`confkv_control`, built after Conf-KV-L ran).
"""
from __future__ import annotations

BUDGETS = (256, 512)
SINKS = 4
PROTECT = 32
SNAP_WINDOW = 32
BLOCK_SIZE = 16
GAMMA = 0.99        # with GAP: the cache stands at the loose budget on >= 30 % of steps (docs/eviction.md)
GAP = 10
FAMILIES = ("sliding", "streamingllm", "h2o", "scissorhands", "snapkv", "pyramidkv", "block", "confkv_l",
            "confkv_int8", "confkv_l_fixed")
CONTROL = "confkv_l_fixed"     # built per prompt from Conf-KV-L's mean length (not in long_policies' output)


def row_name(family: str, budget: int) -> str:
    return f"{family}_b{budget}"


def check_budget(budget: int, tokens: int, gap: int) -> None:
    """A budget the study can build every family at (clear error otherwise)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 64:
        raise ValueError(f"budget={budget!r} must be an int >= 64 entries (--budgets 256,512)")
    if isinstance(gap, bool) or not isinstance(gap, int) or not 0 < gap <= budget // 2:
        raise ValueError(f"gap={gap!r} must be an int in [1, budget // 2 = {budget // 2}] (--confkv-gap: loose - "
                         "tight of Conf-KV)")
    if budget - tokens // 2 <= SNAP_WINDOW:
        raise ValueError(f"budget={budget} leaves no room for SnapKV's cut with tokens={tokens}: need budget - "
                         f"tokens // 2 > {SNAP_WINDOW}")


def _confkv(budget_loose: int, budget_tight: int, *, gamma: float, pyramidal: bool):
    from kvlab.eviction import EVICTION_POLICIES as E

    cls = E.entry("confkv").cls
    return cls(tight=budget_tight, loose=budget_loose, protect=PROTECT, sinks=SINKS, gamma=float(gamma),
               pyramidal=pyramidal, int8_window=PROTECT)


def long_policies(budget: int, *, tokens: int, gamma: float = GAMMA, gap: int = GAP,
                  families: tuple[str, ...] = FAMILIES) -> dict[str, object]:
    """``{row name: policy}`` of every family in ``families`` at ``budget`` entries (module docstring), but the
    confidence-off control (``confkv_l_fixed``; :func:`confkv_control`). ``tokens``: the continuation's length
    (SnapKV / PyramidKV's cut leaves room for it)."""
    from kvlab.eviction import EVICTION_POLICIES as E

    check_budget(budget, tokens, gap)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"families has unknown {unknown}; choose from {', '.join(FAMILIES)}")
    b, cut = budget, budget - tokens // 2
    make = {
        "sliding": lambda: E.entry("sliding").at_budget(b, sinks=SINKS),
        "streamingllm": lambda: E.entry("streamingllm").at_budget(b, sinks=SINKS),
        "h2o": lambda: E.entry("h2o").at_budget(b, recent=b // 2, sinks=0),
        "scissorhands": lambda: E.entry("scissorhands").at_budget(b, sinks=SINKS),
        "snapkv": lambda: E.entry("snapkv").at_budget(cut, recent=SNAP_WINDOW),
        "pyramidkv": lambda: E.entry("pyramidkv").at_budget(cut, recent=SNAP_WINDOW),
        "block": lambda: E.entry("block").at_budget(b, block_size=BLOCK_SIZE, sinks=SINKS),
        "confkv_l": lambda: _confkv(b, b - gap, gamma=gamma, pyramidal=True),
        "confkv_int8": lambda: _confkv(b, b - gap, gamma=gamma, pyramidal=False),
    }
    return {row_name(f, b): make[f]() for f in families if f != CONTROL}


def confkv_control(mean_read: float, *, pyramidal: bool = True):
    """Conf-KV-L's confidence-off control at the same mean memory: its ranker, pyramid and INT8 storage at one
    fixed budget ``K`` (``gamma = 0``: every step confident, ``tight = loose = K``). ``mean_read``: Conf-KV-L's
    mean live length read by its scored forwards (the budget after each cut + the step's new entry), so
    ``K = round(mean_read) - 1`` reads the same mean."""
    k = max(2 * (PROTECT + SINKS) + 2, int(round(mean_read)) - 1)     # the pyramid's deepest layer keeps ranked slots
    return _confkv(k, k, gamma=0.0, pyramidal=pyramidal)
