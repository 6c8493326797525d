"""What the playground's controls hold: one frozen :class:`Settings`, checked control by control,
turned into a :class:`~kvlab.decode.DecodeConfig`.
Frozen values and checks; it touches nothing.

A :class:`Settings` may hold bad values (that is what a user typed); :func:`check` returns
``{control: message}`` for every bad one, and :func:`decode_config` builds the config of a good one.
Messages name the control and the fix. Float controls are rounded to 6 decimals (:func:`normalize`)
so a slider position and a precomputed grid point give the same run-store key.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from kvlab.core.registry import init_fields
from kvlab.decode import MODES, REFRESH_NEXT, DecodeConfig, Sampling
from kvlab.refresh.policies import REFRESH_POLICIES

_LABELS = {"none": "none", "periodic": "periodic (T, W)", "entropy": "entropy gate (τ)",
           "probe_kl": "probe-KL (M, κ)", "speculative": "speculative (k)", "mc": "MC-dropout gate"}
# the controls each built-in refresh policy reads (besides refresh_next)
_PARAMS = {"none": (), "periodic": ("T", "W"), "entropy": ("tau_bits", "W"), "probe_kl": ("M", "kappa", "W"),
           "speculative": ("k",), "mc": ("mc_signal", "mc_threshold", "mc_every", "mc_passes", "mc_p")}
# controls a registered refresh policy's fields of the same name are fed from (register_refresh(controls=) adds others)
REFRESH_CONTROLS = ("T", "W", "tau_bits", "M", "kappa", "k")


class _Policies(Sequence):
    """The refresh menu: "none", then every policy of ``kvlab.refresh.policies.REFRESH_POLICIES`` (the built-ins,
    then the user's ``register_refresh``), read from the registry at each use."""

    def _names(self) -> tuple[str, ...]:
        return ("none", *REFRESH_POLICIES)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return repr(self._names())


def user_controls(name: str) -> dict[str, str]:
    """A registered (non-built-in) refresh policy's controls: playground control -> constructor field (its
    fields named like a control in :data:`REFRESH_CONTROLS`, plus ``register_refresh(controls=...)``)."""
    entry = REFRESH_POLICIES.entry(name)
    return {**{f: f for f in init_fields(entry.cls) if f in REFRESH_CONTROLS}, **entry.controls}


class _PerPolicy(Mapping):
    """A built-in table per refresh policy, completed for registered ones by ``of_user(name)``."""

    def __init__(self, builtin: dict, of_user):
        self._builtin, self._of_user = builtin, of_user

    def __getitem__(self, name):
        if name in self._builtin:
            return self._builtin[name]
        if name not in REFRESH_POLICIES:
            raise KeyError(name)
        return self._of_user(name)

    def __iter__(self):
        return iter(POLICIES)

    def __len__(self) -> int:
        return len(POLICIES)


POLICIES = _Policies()
POLICY_LABELS = _PerPolicy(_LABELS, lambda n: REFRESH_POLICIES.entry(n).label)
POLICY_PARAMS = _PerPolicy(_PARAMS, lambda n: tuple(user_controls(n)))
SAMPLINGS = ("greedy", "sample")
MC_SIGNALS = ("mi", "u", "flip")
NO_EVICTION = "full"
PRUNED = "pruned"         # the untrained student variant (the only one whose prune ratio the playground sets)


class _EvictParams(Mapping):
    """The eviction controls each eviction policy reads besides the budget: its registration's ``controls``
    (``register_eviction(controls={control: from_budget keyword})``), read from the registry at each use."""

    def _table(self) -> dict:
        from kvlab.eviction import EVICTION_POLICIES

        return {n: tuple(EVICTION_POLICIES.entry(n).controls) for n in EVICTION_POLICIES
                if EVICTION_POLICIES.entry(n).controls}

    def __getitem__(self, name):
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


EVICT_PARAMS = _EvictParams()
# controls that pick *which* runs are averaged (spread), not how one run decodes
SPREAD_CONTROLS = ("n_prompts", "n_seeds")


@dataclass(frozen=True)
class Range:
    """A slider's range: ``lo .. hi`` in steps of ``step`` (ints when all three are ints)."""

    lo: float
    hi: float
    step: float

    @property
    def integer(self) -> bool:
        return all(isinstance(v, int) for v in (self.lo, self.hi, self.step))

    def positions(self) -> list:
        """Every slider position, in order (what "precompute the whole range" runs)."""
        n = int(round((self.hi - self.lo) / self.step))
        if self.integer:
            return [self.lo + i * self.step for i in range(n + 1)]
        return [round(self.lo + i * self.step, 6) for i in range(n + 1)]

    def __contains__(self, v) -> bool:
        return self.lo - 1e-9 <= v <= self.hi + 1e-9


# Slider ranges (the view builds its sliders from these; a Playground may override them).
RANGES = {
    "T": Range(1, 256, 1),
    "W": Range(0, 256, 1),              # 0 = no window
    "tau_bits": Range(0.0, 8.0, 0.1),
    "M": Range(1, 64, 1),
    "kappa": Range(0.0, 4.0, 0.05),
    "k": Range(1, 128, 1),
    "mc_threshold": Range(0.0, 2.0, 0.01),   # replaced per signal by the calibrated range (Playground.mc_range)
    "mc_every": Range(1, 64, 1),
    "mc_passes": Range(2, 32, 1),
    "mc_p": Range(0.0, 0.5, 0.01),
    "gamma": Range(0.0, 1.0, 0.01),
    "recent": Range(0, 1024, 1),
    "n_prompts": Range(1, 16, 1),
    "n_seeds": Range(1, 8, 1),
    "temperature": Range(0.05, 2.0, 0.05),
    "top_p": Range(0.05, 1.0, 0.05),
    "budget": Range(8, 1024, 8),
}
PRUNE_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5)
MAX_N = 4096


@dataclass(frozen=True)
class Settings:
    """Every control of the playground. Refresh-policy fields are read only for the chosen policy."""

    prompt: str
    mode: str = "overfill"             # teacher | student | overfill
    policy: str = "entropy"            # one of POLICIES ("none", kvlab.refresh.policies.REFRESH_POLICIES)
    T: int = 16                        # periodic: refresh after steps T, 2T, ...
    W: int = 0                         # window: most entries one refresh rewrites (0 = no window)
    tau_bits: float = 3.0              # entropy gate threshold, bits
    M: int = 8                         # probe-KL: probe every M steps
    kappa: float = 0.5                 # probe-KL threshold, nats
    k: int = 8                         # speculative burst length
    mc_signal: str = "mi"              # MC gate signal
    mc_threshold: float = 0.05         # MC gate threshold (signal units)
    mc_every: int = 4                  # MC gate: probe (and refractory gap) every this many steps
    mc_passes: int = 8                 # MC gate: noisy student passes per probe
    mc_p: float = 0.1                  # MC gate: dropout probability of those passes
    refresh_next: str = "rerun"        # who picks the token after a refresh
    student: str = "pruned"            # student variant (kvlab.core.models.STUDENT_VARIANTS; "pruned" = untrained)
    prune_ratio: float = 0.3           # pruned student: teacher with this fraction of MLP channels pruned
    N: int = 64                        # new tokens
    sampling: str = "sample"           # greedy | sample
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int = 0
    evict: str = NO_EVICTION           # "full" (no eviction) or a key of kvlab.eviction.EVICTION_POLICIES
    budget: int = 64                   # eviction budget (cache entries)
    gamma: float = 0.9                 # Conf-KV confidence threshold γ (the eviction experiments' 0.9; the paper's 0.7)
    recent: int = 16                   # H2O / random eviction: newest entries always kept (< budget)
    n_prompts: int = 1                 # spread: this prompt and the next n_prompts-1 of the list ...
    n_seeds: int = 1                   # ... each with seeds seed .. seed+n_seeds-1 (readouts: mean ± paired CI)

    def replace(self, **changes) -> "Settings":
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown control(s) {sorted(unknown)}; known: {[f.name for f in fields(self)]}")
        return normalize(replace(self, **changes))

    def baseline(self) -> "Settings":
        """The run every readout is compared with: same prompt, mode, student, N, sampling and seed,
        no refresh and the full cache."""
        return replace(self, policy="none", evict=NO_EVICTION)

    def relevant(self) -> dict:
        """The controls that change this configuration's run (for labels and grids)."""
        keep = {"prompt", "mode", "policy", "N", "sampling", "seed", "evict"}
        if self.mode != "teacher":
            keep.add("student")
            if self.student == PRUNED:
                keep.add("prune_ratio")
        if self.policy != "none":
            keep.update(POLICY_PARAMS[self.policy])
            keep.add("refresh_next")
        if self.sampling == "sample":
            keep.update(("temperature", "top_p"))
        if self.evict != NO_EVICTION:
            keep.add("budget")
            keep.update(EVICT_PARAMS.get(self.evict, ()))
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in keep}


def normalize(s: Settings) -> Settings:
    """Floats rounded to 6 decimals (slider positions and grid points key the same run)."""
    changes = {}
    for f in fields(s):
        v = getattr(s, f.name)
        if isinstance(v, float) and math.isfinite(v):
            r = round(v, 6)
            if r != v:
                changes[f.name] = r
    return replace(s, **changes) if changes else s


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check(s: Settings, *, vocab_size: int | None = None, eviction_names=(), ranges=None,
          prune_ratios=PRUNE_RATIOS, students=(None,)) -> dict[str, str]:
    """``{control: message}`` for every bad control of ``s`` (empty when all are good)."""
    R = {**RANGES, **(ranges or {})}
    err: dict[str, str] = {}
    if not isinstance(s.prompt, str) or not s.prompt.strip():
        err["prompt"] = "prompt is empty: pick one from the list or type some text"
    if s.mode not in MODES:
        err["mode"] = f"mode={s.mode!r} must be one of {MODES}"
    if not _is_int(s.N) or not 1 <= s.N <= MAX_N:
        err["N"] = f"N={s.N!r} must be a whole number of new tokens in 1..{MAX_N}"
    n = s.N if "N" not in err else None
    if s.policy not in POLICIES:
        err["policy"] = f"policy={s.policy!r} must be one of {POLICIES}"
    elif s.policy != "none" and s.mode != "overfill":
        err["policy"] = (f"a refresh needs mode='overfill' (the teacher corrects the student's cache); "
                         f"with mode={s.mode!r} pick policy 'none'")
    pol = s.policy if s.policy in POLICIES else "none"
    used = POLICY_PARAMS[pol]

    def int_in(name, lo, hi, why=""):
        v = getattr(s, name)
        if not _is_int(v) or not lo <= v <= hi:
            err[name] = f"{name}={v!r} must be a whole number in {lo}..{hi}{why}"

    if "T" in used:
        int_in("T", 1, min(n, int(R["T"].hi)) if n else int(R["T"].hi), " (T > N never refreshes: pick policy 'none')")
    if "W" in used:
        int_in("W", 0, int(R["W"].hi), " (0 = no window)")
    if "k" in used:
        int_in("k", 1, min(n, int(R["k"].hi)) if n else int(R["k"].hi), " (k > N never refreshes)")
    if "M" in used:
        int_in("M", 1, min(n, int(R["M"].hi)) if n else int(R["M"].hi), " (M > N never probes)")
    if "mc_every" in used:
        int_in("mc_every", 1, min(n, int(R["mc_every"].hi)) if n else int(R["mc_every"].hi), " (more than N never probes)")
    if "tau_bits" in used:
        hi = min(R["tau_bits"].hi, math.log2(vocab_size)) if vocab_size else R["tau_bits"].hi
        if not _is_num(s.tau_bits) or not 0 <= s.tau_bits <= hi:
            err["tau_bits"] = (f"tau_bits={s.tau_bits!r} must be in 0..{hi:.2f} bits"
                               + (f" (log2 of the vocabulary, {vocab_size}, is the largest entropy)" if vocab_size else ""))
    if "kappa" in used and (not _is_num(s.kappa) or s.kappa not in R["kappa"]):
        err["kappa"] = f"kappa={s.kappa!r} must be in {R['kappa'].lo}..{R['kappa'].hi} nats"
    if "mc_signal" in used and s.mc_signal not in MC_SIGNALS:
        err["mc_signal"] = f"mc_signal={s.mc_signal!r} must be one of {MC_SIGNALS}"
    if "mc_threshold" in used and (not _is_num(s.mc_threshold) or s.mc_threshold < 0):
        err["mc_threshold"] = f"mc_threshold={s.mc_threshold!r} must be a number >= 0"
    if pol != "none" and s.refresh_next not in REFRESH_NEXT:
        err["refresh_next"] = f"refresh_next={s.refresh_next!r} must be one of {REFRESH_NEXT}"
    offered = tuple(students) if students != (None,) else (PRUNED,)
    if s.mode != "teacher" and s.student not in offered:
        err["student"] = f"student={s.student!r} must be one of {offered}"
    if s.mode != "teacher" and s.student == PRUNED and s.prune_ratio not in prune_ratios:
        err["prune_ratio"] = f"prune_ratio={s.prune_ratio!r} must be one of {tuple(prune_ratios)}"
    if s.sampling not in SAMPLINGS:
        err["sampling"] = f"sampling={s.sampling!r} must be one of {SAMPLINGS}"
    elif s.sampling == "sample":
        if not _is_num(s.temperature) or not 0 < s.temperature <= R["temperature"].hi:
            err["temperature"] = f"temperature={s.temperature!r} must be in (0, {R['temperature'].hi}] (or pick greedy)"
        if not _is_num(s.top_p) or not 0 < s.top_p <= 1:
            err["top_p"] = f"top_p={s.top_p!r} must be in (0, 1]"
    if not _is_int(s.seed) or s.seed < 0:
        err["seed"] = f"seed={s.seed!r} must be a whole number >= 0"
    int_in("n_prompts", 1, int(R["n_prompts"].hi), " (prompts averaged over)")
    int_in("n_seeds", 1, int(R["n_seeds"].hi), " (seeds per prompt averaged over)")
    if "n_seeds" not in err and s.n_seeds > 1 and s.sampling == "greedy":
        err["n_seeds"] = (f"n_seeds={s.n_seeds} with greedy decoding repeats the same run {s.n_seeds} times: "
                          "use n_seeds=1 or sampling='sample'")
    if "mc_passes" in used:
        int_in("mc_passes", 2, int(R["mc_passes"].hi), " (a variance needs at least two passes)")
    if "mc_p" in used and (not _is_num(s.mc_p) or not 0 <= s.mc_p < 1 or s.mc_p not in R["mc_p"]):
        err["mc_p"] = f"mc_p={s.mc_p!r} must be a dropout probability in {R['mc_p'].lo}..{R['mc_p'].hi} (0 = no noise)"
    if s.evict != NO_EVICTION:
        if s.evict not in eviction_names:
            err["evict"] = f"evict={s.evict!r} must be one of {(NO_EVICTION, *eviction_names)}"
        if not _is_int(s.budget) or not 1 <= s.budget <= int(R["budget"].hi):
            err["budget"] = f"budget={s.budget!r} must be a whole number of cache entries in 1..{int(R['budget'].hi)}"
        ev_used = EVICT_PARAMS.get(s.evict, ())
        if "gamma" in ev_used and (not _is_num(s.gamma) or not 0 <= s.gamma <= 1):
            err["gamma"] = f"gamma={s.gamma!r} must be a confidence threshold in 0..1 (Conf-KV prunes to tight when c >= γ)"
        if "recent" in ev_used:
            if not _is_int(s.recent) or s.recent < 0:
                err["recent"] = f"recent={s.recent!r} must be a whole number of entries >= 0"
            elif "budget" not in err and s.recent >= s.budget:
                err["recent"] = f"recent={s.recent} must be below budget={s.budget} (the recent window is kept inside the budget)"
    if not err and s.evict != NO_EVICTION:
        try:
            eviction_policy(s)
        except ValueError as e:      # the policy's own message, next to the budget it came from
            err["budget"] = f"budget={s.budget} does not fit evict={s.evict!r}: {e}"
    if not err:   # kvlab's own constructors have the last word (they name the field they reject)
        try:
            decode_config(s)
        except ValueError as e:
            err[_control_of(str(e), s.policy)] = str(e)
    return err


# policy field -> control name
_FIELD_CONTROL = {"threshold": "mc_threshold", "probe_every": "mc_every", "signal": "mc_signal", "refractory": "mc_every",
                  "max_new_tokens": "N", "window": "W", "n_passes": "mc_passes", "p": "mc_p", "dropout_p": "mc_p"}


def _control_of(message: str, policy: str | None = None) -> str:
    m = re.match(r"\s*(?:refresh\.)?(\w+)=", message)
    if not m:
        return "policy"
    name = m.group(1)
    if policy in REFRESH_POLICIES.user():     # a registered policy's field -> the control feeding it
        name = {f: c for c, f in user_controls(policy).items()}.get(name, "policy")
    name = _FIELD_CONTROL.get(name, name)
    return name if name in {f.name for f in fields(Settings)} else "policy"


def refresh_policy(s: Settings):
    """The :mod:`kvlab.refresh.policies` object of ``s`` (None for 'none')."""
    from kvlab.refresh.policies import EntropyGate, MCGate, Periodic, ProbeKL, Speculative

    W = s.W or None
    if s.policy == "none":
        return None
    if s.policy == "periodic":
        return Periodic(T=s.T, W=W)
    if s.policy == "entropy":
        return EntropyGate(tau_bits=float(s.tau_bits), W=W)
    if s.policy == "probe_kl":
        return ProbeKL(M=s.M, kappa=float(s.kappa), W=W)
    if s.policy == "speculative":
        return Speculative(k=s.k)
    if s.policy == "mc":
        # refractory = probe interval: at most one refresh per probe (the default 32 would never fire on short runs)
        return MCGate(threshold=float(s.mc_threshold), signal=s.mc_signal, probe_every=s.mc_every, refractory=s.mc_every,
                      n_passes=s.mc_passes, dropout_p=float(s.mc_p))
    if s.policy not in POLICIES:
        raise ValueError(f"policy={s.policy!r} must be one of {POLICIES}")
    cls = REFRESH_POLICIES[s.policy]           # a registered policy: its fields from their controls, else defaults
    kw = {fld: (s.W or None) if control == "W" else getattr(s, control)
          for control, fld in user_controls(s.policy).items()}
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"policy={s.policy!r}: {cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kw.items())}) "
                         f"fails ({e}); give its fields defaults or feed them from playground controls with "
                         f"register_refresh({s.policy!r}, controls={{control: field}})") from None


def eviction_policies() -> dict:
    """``kvlab.eviction.EVICTION_POLICIES`` without "full" (the playground's no-eviction choice), then the
    installed kvpress presses that run here (``kvpress:<Class>``, :mod:`kvlab.eviction.kvpress.menu`; none
    without kvpress), or ``{}`` when the eviction package is not there."""
    try:
        from kvlab.eviction import EVICTION_POLICIES
        from kvlab.eviction.kvpress.menu import menu_entries
        from kvlab.eviction.scorer import ScorerPolicy
    except ImportError:
        return {}
    out = {k: v for k, v in EVICTION_POLICIES.items() if k != NO_EVICTION}
    out.update({e: ScorerPolicy for e in menu_entries()})
    return out


def eviction_policy(s: Settings):
    """The eviction policy of ``s`` with its budget (None for the full cache)."""
    if s.evict == NO_EVICTION:
        return None
    from kvlab.eviction.kvpress.menu import is_entry, menu_policy

    if is_entry(s.evict):           # a kvpress press: decode-time eviction at the budget, 4 sinks
        if s.evict not in eviction_policies():
            raise ValueError(f"evict={s.evict!r} is not available; known: {sorted(eviction_policies())}")
        return menu_policy(s.evict, s.budget, sinks=4, every_step=True)
    cls = eviction_policies().get(s.evict)
    if cls is None:
        raise ValueError(f"evict={s.evict!r} is not available; known: {sorted(eviction_policies())}")
    return budget_policy(s.evict, cls, s.budget, seed=s.seed, gamma=s.gamma, recent=s.recent)


def budget_policy(name: str, cls, budget: int, seed: int = 0, gamma: float | None = None, recent: int | None = None):
    """Eviction policy ``name`` of the registry holding at most about ``budget`` cache entries: its
    ``Entry.at_budget`` with the playground's setup — ``seed``, and the controls the policy's registration
    names (``register_eviction(controls=...)``: H2O's and Scissorhands' ``recent``, Conf-KV's ``gamma``;
    ``None`` = the policy's default). Each policy's ``from_budget`` says how the budget maps onto its fields
    (e.g. Conf-KV: ``loose = budget``, ``tight = budget // 2``; block eviction: blocks of 4 with
    ``max_cache_size + 3 <= budget``). ``cls`` is unused (kept for callers). Bad budgets raise the policy's own
    ValueError."""
    from kvlab.eviction import EVICTION_POLICIES

    entry = EVICTION_POLICIES.entry(name)
    given = {"gamma": gamma, "recent": recent}
    setup = {kw: given.get(control) for control, kw in entry.controls.items() if given.get(control) is not None}
    return entry.at_budget(budget, seed=seed, **setup)


def sampling_of(s: Settings) -> Sampling:
    if s.sampling == "greedy":
        return Sampling(temperature=0.0, top_p=1.0, seed=s.seed)
    return Sampling(temperature=float(s.temperature), top_p=float(s.top_p), seed=s.seed)


def decode_config(s: Settings) -> DecodeConfig:
    """The :class:`DecodeConfig` of good settings (kvlab validates it again)."""
    kw = dict(mode=s.mode, max_new_tokens=s.N, sampling=sampling_of(s), refresh=refresh_policy(s),
              refresh_next=s.refresh_next if s.policy != "none" else "rerun")
    ev = eviction_policy(s)
    if ev is not None:
        kw["evict"] = ev
    return DecodeConfig(**kw)


def percentile_of(values, x: float) -> float | None:
    """Where ``x`` falls in ``values``: the percentage of values <= x (the calibrated percentile of a τ)."""
    v = [float(a) for a in values if math.isfinite(a)]
    if not v or not _is_num(x):
        return None
    return 100.0 * sum(1 for a in v if a <= x) / len(v)
