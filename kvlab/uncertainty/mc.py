"""Real Monte-Carlo dropout on any HF student (seed 000, "Future Work (Monte Carlo Dropout)").
It adds forward hooks to a model only inside a ``with`` block that removes them, and probes a cache without changing
it (``KVCache.probe_last``).

The embedded student has no active dropout, so it is *injected* at inference: forward hooks on
each decoder layer's attention and MLP sub-layers multiply their outputs by an inverted-dropout
mask (keep-probability ``1 - p``, scaled by ``1 / (1 - p)``). :func:`mc_dropout` is a context
manager: the hooks come off on exit, error or not; no forward is monkeypatched.

At a decoding step the clean pass (the decode loop's own forward) drives decoding. The N noisy
passes re-run the same step as ONE batch through :meth:`KVCache.probe_last`, which shares the
prefix cache (``expand`` views) and discards the N noisy entries — the decoding cache, its ledger
and its tensors are bit-identical afterwards.

Per-step signals from the N noisy logit vectors ``Z`` (N, V) and the clean logits ``z0`` (V,):

* ``u``    — the seed's U(t): mean over the vocabulary of the across-pass logit variance. The
  variance is the *population* variance (divide by N, numpy's ``Z.var(axis=0)`` as in the seed's
  simulation), not the unbiased one.
* ``mi``   — mutual information (BALD), nats: entropy of the pass-averaged distribution minus the
  mean entropy of the passes.
* ``flip`` — fraction of noisy passes whose argmax differs from the clean pass's argmax.
* ``h_pred`` — entropy (nats) of the pass-averaged distribution (the seed's simulated entropy).

:class:`MCGate` is the refresh policy built on them; :func:`mc_probe` is the probe the refresh
loop calls at due steps (``PROBES["mc"]``).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from kvlab.refresh.base import ProbeResult, register_probe
from kvlab.core.registry import register_refresh


SIGNALS = ("u", "mi", "flip")
DEFAULT_PASSES = 8
DEFAULT_P = 0.1
SUBLAYERS = ("self_attn", "mlp")


# ----------------------------------------------------------------------------- validation


def check_p(p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r} must be a dropout probability in [0, 1) (0 = no noise)")
    return float(p)


def check_n_passes(n_passes) -> int:
    if isinstance(n_passes, bool) or not isinstance(n_passes, int) or n_passes < 2:
        raise ValueError(f"n_passes={n_passes!r} must be an int >= 2 (a variance needs at least two passes)")
    return n_passes


def check_percentile(percentile) -> float:
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile < 100:
        raise ValueError(f"percentile={percentile!r} must lie in (0, 100), e.g. 70 or 90")
    return float(percentile)


def check_signal(signal) -> str:
    if signal not in SIGNALS:
        raise ValueError(f"signal={signal!r} must be one of {SIGNALS} (U(t), mutual information, argmax-flip rate)")
    return signal


# ----------------------------------------------------------------------------- dropout hooks


def dropout_targets(model, sublayers: Sequence[str] = SUBLAYERS) -> list[torch.nn.Module]:
    """The sub-layer modules whose outputs get dropout: for every module that has children named
    in ``sublayers`` (a decoder layer), those children, in model order."""
    targets = []
    for module in model.modules():
        for name in sublayers:
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.Module) and child in module.children():
                targets.append(child)
    return targets


@contextmanager
def mc_dropout(model, p: float, *, seed: int | None = None, sublayers: Sequence[str] = SUBLAYERS):
    """Inject inverted dropout (probability ``p``) on every decoder layer's sub-layer outputs.

    Yields the number of hooked modules. Every element of every batch row gets its own mask, so
    a batch of N copies is N independent MC passes. ``seed`` fixes the masks (one generator on
    the model's device). ``p == 0`` leaves outputs untouched. Hooks are removed on exit, also on
    error.
    """
    p = check_p(p)
    targets = dropout_targets(model, sublayers)
    if not targets:
        raise ValueError(f"sublayers={tuple(sublayers)!r}: no decoder layer of {type(model).__name__} has such "
                         "children; pass the attribute names of its attention/MLP sub-layers")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(int(seed))
    else:
        gen.seed()
    scale = 1.0 / (1.0 - p)

    def drop(x: torch.Tensor) -> torch.Tensor:
        mask = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)   # (B, T, hidden)
        return x * mask * scale

    def hook(module, args, output):
        if p == 0.0:
            return None
        if isinstance(output, torch.Tensor):
            return drop(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (drop(output[0]),) + tuple(output[1:])
        raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; mc_dropout handles a "
                        "tensor or a tuple whose first element is the hidden states")

    handles = []
    try:
        for m in targets:
            handles.append(m.register_forward_hook(hook))
        yield len(targets)
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- signals


def mc_signals(noisy: torch.Tensor, clean: torch.Tensor) -> dict[str, float]:
    """``u``, ``mi``, ``flip``, ``h_pred`` of N noisy logit vectors ``(N, V)`` vs the clean ``(V,)``.

    Computed in float64. ``u`` uses the population variance (÷N) like the seed's ``Z.var(axis=0)``.
    """
    Z = torch.as_tensor(noisy).detach().to(torch.float64)           # (N, V)
    z0 = torch.as_tensor(clean).detach().to(torch.float64).reshape(-1)
    if Z.dim() != 2 or Z.shape[0] < 2:
        raise ValueError(f"noisy must be (N >= 2, V) logits, got shape {tuple(Z.shape)}")
    if z0.numel() != Z.shape[1]:
        raise ValueError(f"clean has {z0.numel()} logits, noisy passes have V={Z.shape[1]}")
    u = Z.var(dim=0, unbiased=False).mean()
    logp = torch.log_softmax(Z, dim=-1)                              # (N, V)
    p = logp.exp()
    h_each = -(p * logp).sum(-1)                                     # (N,)
    pbar = p.mean(0)                                                 # (V,)
    h_pred = float(torch.special.entr(pbar).sum())
    mi = h_pred - float(h_each.mean())
    flip = float((Z.argmax(-1) != z0.argmax()).double().mean())
    return {"u": float(u), "mi": max(mi, 0.0), "flip": flip, "h_pred": h_pred}


def mc_step(model, cache, clean_logits: torch.Tensor, *, n_passes: int = DEFAULT_PASSES, p: float = DEFAULT_P,
            seed: int | None = None) -> dict[str, float]:
    """N noisy passes of the current step (one batch, prefix shared, cache untouched) -> signals."""
    n_passes, p = check_n_passes(n_passes), check_p(p)
    with mc_dropout(model, p, seed=seed):
        Z = cache.probe_last(model, n_passes)                        # (N, V)
    return mc_signals(Z, clean_logits)


# ----------------------------------------------------------------------------- the refresh probe


def _step_seed(base: int, step: int) -> int:
    return (int(base) * 1_000_003 + int(step)) % (2**63 - 1)


def make_mc_probe(n_passes: int = DEFAULT_PASSES, p: float = DEFAULT_P, seed: int | None = None):
    """A probe ``fn(ctx) -> ProbeResult`` with fixed MC parameters.

    ``ctx`` is the refresh loop's ``ProbeContext``; the probe uses ``ctx.student``,
    ``ctx.cache`` (the decoding cache the step's logits came from: its last entry is the token
    fed at this step), ``ctx.logits`` (the clean pass, ``(V,)``) and ``ctx.step``. Masks are
    seeded from ``seed`` (default: ``ctx.config.sampling.seed``) and the step, so runs repeat.
    Signals: ``mc_u``, ``mc_mi``, ``mc_flip``, ``mc_h_pred``; cost ``{"student_passes": N}``.
    """
    n_passes, p = check_n_passes(n_passes), check_p(p)

    def probe(ctx):
        base = seed if seed is not None else getattr(getattr(ctx.config, "sampling", None), "seed", 0)
        lm = ctx.student
        model = getattr(lm, "model", lm)
        sig = mc_step(model, ctx.cache, ctx.logits, n_passes=n_passes, p=p, seed=_step_seed(base, ctx.step))
        return ProbeResult(signals={f"mc_{k}": v for k, v in sig.items()}, cost={"student_passes": float(n_passes)})

    probe.n_passes, probe.p = n_passes, p
    return probe


@register_probe("mc")
def mc_probe(ctx):
    """``PROBES["mc"]`` (registered when this module is imported — constructing an MCGate does): MC-dropout signals at a due step.

    N and p come from the run's refresh policy when the loop's config carries it as
    ``ctx.config.refresh`` with ``n_passes`` / ``dropout_p`` attributes (an :class:`MCGate` does),
    else :data:`DEFAULT_PASSES` / :data:`DEFAULT_P`.
    """
    policy = getattr(ctx.config, "refresh", None)
    n = getattr(policy, "n_passes", DEFAULT_PASSES)
    p = getattr(policy, "dropout_p", DEFAULT_P)
    return make_mc_probe(n, p)(ctx)


# ----------------------------------------------------------------------------- the gate


def _since_refresh(record):
    """Steps since the last refresh, from the loop's record (``since_refresh``; ``steps_since_refresh``
    accepted too). ``None`` means "no refresh to count from"."""
    for name in ("since_refresh", "steps_since_refresh"):
        if hasattr(record, name):
            return getattr(record, name)
    raise AttributeError("MCGate needs record.since_refresh (steps since the last refresh) for its refractory "
                         "gap; the refresh loop must set it on every record")


@register_refresh("mc", order=4)
@dataclass(frozen=True)
class MCGate:
    """Refresh when the chosen MC signal exceeds ``threshold`` at a probe step, at least
    ``refractory`` steps after the last refresh.

    Protocol (the refresh loop's probes, kvlab.refresh.base): ``probe == "mc"`` — the loop runs ``PROBES["mc"](ctx)``
    every ``probe_every`` steps and puts its signals on the record (``record.signals``), and
    adds its cost (``n_passes`` student passes) to the run's. The loop must also expose
    ``record.since_refresh`` (steps since the last refresh; the refresh loop counts from the
    prefill, i.e. ``step`` before any refresh; ``None`` = never, the seed's convention): the gate
    keeps no state. Steps without MC signals never fire.
    """

    threshold: float
    signal: str = "mi"
    probe_every: int = 16
    refractory: int = 32
    n_passes: int = DEFAULT_PASSES
    dropout_p: float = DEFAULT_P
    probe: str = field(default="mc", init=False)

    def __post_init__(self):
        check_signal(self.signal)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
            raise ValueError(f"threshold={self.threshold!r} must be a finite number (or use MCGate.calibrated)")
        for name, lo in (("probe_every", 1), ("refractory", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an int >= {lo}")
        check_n_passes(self.n_passes)
        check_p(self.dropout_p)

    @property
    def key(self) -> str:
        """The record signal this gate reads."""
        return f"mc_{self.signal}"

    def should_refresh(self, record) -> bool:
        value = (getattr(record, "signals", None) or {}).get(self.key)
        if value is None:
            return False
        since = _since_refresh(record)
        if since is not None and since < self.refractory:
            return False
        return float(value) > self.threshold

    def explain(self, record) -> str:
        """Why :meth:`should_refresh` fired (or not) at ``record``, in words."""
        value = (getattr(record, "signals", None) or {}).get(self.key)
        if value is None:
            return f"no MC probe at step {record.step} (probes every {self.probe_every} steps)"
        since = _since_refresh(record)
        head = f"MC {self.signal} {float(value):.3g} {'>' if float(value) > self.threshold else '≤'} threshold {self.threshold:g}"
        if float(value) > self.threshold and since is not None and since < self.refractory:
            return f"{head}, but only {since} step(s) since the last refresh (refractory {self.refractory})"
        return head

    @classmethod
    def calibrated(cls, teacher, student, *, percentile: float, signal: str = "mi", prompts: Iterable[str] | None = None,
                   tokens: int = 32, **fields) -> "MCGate":
        """A gate whose threshold is the ``percentile``-th percentile of ``signal`` over decodes of
        the calibration prompts (default ``data/calibration.jsonl``), probed at every step (the
        signal's distribution, not just the gate's probe steps); see :func:`calibrate`."""
        check_percentile(percentile)
        draft = cls(threshold=0.0, signal=signal, **fields)      # validates every field before any decoding
        tau = calibrate(teacher, student, percentile=percentile, signal=signal, prompts=prompts, tokens=tokens,
                        n_passes=draft.n_passes, p=draft.dropout_p)
        return cls(threshold=tau, signal=signal, **fields)


# ----------------------------------------------------------------------------- traces


def mc_trace(teacher, student, prompt: str, *, tokens: int = 64, n_passes: int = DEFAULT_PASSES, p: float = DEFAULT_P,
             probe_every: int = 1, mode: str = "overfill", sampling=None, seed: int = 0):
    """Decode ``prompt`` with the clean pass; at every ``probe_every``-th step whose distribution
    the student computed, run the MC probe on the decoding cache. One row per probed step:
    step, token, student entropy (bits and nats), u, mi, flip, h_pred, student_passes.

    (In overfill, step 1's distribution is the teacher's prefill and is not probed.)
    """
    import pandas as pd

    from kvlab.decode import DecodeConfig, Decoding, Sampling

    n_passes, p = check_n_passes(n_passes), check_p(p)
    if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
        raise ValueError(f"probe_every={probe_every!r} must be a positive int")
    cfg = DecodeConfig(mode=mode, max_new_tokens=tokens, sampling=sampling or Sampling(), keep_dists=True)
    d = Decoding(teacher, student, prompt, cfg)
    model = student.model
    rows = []
    for rec in d:
        clean = d.dists.pop()                # log-probs of this step's clean pass (same argmax); not kept
        if rec.source == "student" and rec.step % probe_every == 0:
            sig = mc_step(model, d.cache, clean, n_passes=n_passes, p=p, seed=_step_seed(seed, rec.step))
            rows.append({"step": rec.step, "token": rec.token, "entropy_bits": rec.entropy_bits,
                         "entropy": rec.entropy_bits * math.log(2.0), **sig, "student_passes": n_passes})
    return pd.DataFrame(rows)


def mc_traces(teacher, student, prompts: Sequence[str], **kw):
    """:func:`mc_trace` over several prompts, with a prompt column. Prompt i uses dropout seed
    ``seed + i`` and, if ``sampling`` is given, sampling seed ``sampling.seed + i`` (paired seeds)."""
    import pandas as pd

    from dataclasses import replace

    base = kw.pop("seed", 0)
    sampling = kw.pop("sampling", None)
    frames = []
    for i, prompt in enumerate(prompts):
        samp = None if sampling is None else replace(sampling, seed=sampling.seed + i)
        df = mc_trace(teacher, student, prompt, seed=base + i, sampling=samp, **kw)
        df.insert(0, "prompt", i)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def calibrate(teacher, student, *, percentile: float, signal: str = "mi", prompts: Iterable[str] | None = None,
              tokens: int = 32, n_passes: int = DEFAULT_PASSES, p: float = DEFAULT_P, probe_every: int = 1) -> float:
    """The ``percentile``-th percentile of ``signal`` over MC traces of the calibration prompts."""
    return calibration_thresholds(teacher, student, percentile=percentile, signals=(signal,), prompts=prompts,
                                  tokens=tokens, n_passes=n_passes, p=p, probe_every=probe_every)[signal]


def calibration_thresholds(teacher, student, *, percentile: float, signals: Sequence[str] = SIGNALS,
                           prompts: Iterable[str] | None = None, tokens: int = 32, n_passes: int = DEFAULT_PASSES,
                           p: float = DEFAULT_P, probe_every: int = 1) -> dict[str, float]:
    """``{signal: percentile-th percentile}`` over one set of MC traces of the calibration prompts
    (default: all of ``data/calibration.jsonl``), greedy OverFill decodes of ``tokens`` tokens."""
    import numpy as np

    percentile = check_percentile(percentile)
    signals = [check_signal(s) for s in signals]
    check_n_passes(n_passes), check_p(p)
    if prompts is None:
        from kvlab.core.data import calibration_file, load_prompts

        prompts = [r["prompt"] for r in load_prompts(calibration_file())]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty; pass calibration prompts or leave it None for data/calibration.jsonl")
    df = mc_traces(teacher, student, prompts, tokens=tokens, n_passes=n_passes, p=p, probe_every=probe_every)
    if df.empty:
        raise ValueError(f"tokens={tokens} produced no probed student steps; raise tokens")
    return {s: float(np.percentile(df[s].to_numpy(), percentile)) for s in signals}
