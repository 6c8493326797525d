"""The long-context eviction study's runs (through the run store, one result per (context, prompt, policy)) and
its table ``evict_long`` (one row per (policy, context)); see :mod:`kvlab.studies.eviction.long`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from kvlab.studies.eviction.long import STUDY_VERSION, control_rows, perplexity, run_prompt
from kvlab.studies.eviction.long_policies import BUDGETS, CONTROL, FAMILIES, GAMMA, GAP, long_policies, row_name

CONTEXTS = (2048, 4096, 8192)
REFERENCE = 512           # the paper's gap: a 512-entry sliding window vs the full cache


@dataclass(frozen=True)
class LongStudy:
    """Sizes of the long-context study (``evict-long`` flags)."""

    contexts: tuple[int, ...] = CONTEXTS
    prompts: int = 32
    tokens: int = 32
    budgets: tuple[int, ...] = BUDGETS
    gamma: float = GAMMA
    gap: int = GAP
    families: tuple[str, ...] = FAMILIES

    def __post_init__(self):
        for name, vals in (("contexts", self.contexts), ("budgets", self.budgets)):
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise ValueError(f"{name}={vals!r} must be a non-empty tuple of positive ints (--{name} 2048,4096)")
        if any(c > 8192 for c in self.contexts):
            raise ValueError(f"contexts={self.contexts!r}: the embedded model has 8,192 positions (--contexts <= 8192)")
        if isinstance(self.prompts, bool) or not isinstance(self.prompts, int) or self.prompts < 1:
            raise ValueError(f"prompts={self.prompts!r} must be a positive int (--prompts)")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 4:
            raise ValueError(f"tokens={self.tokens!r} must be an int >= 4 (--tokens: forced continuation length)")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma={self.gamma!r} must be in [0, 1] (--gamma)")
        for b in self.budgets:
            long_policies(b, tokens=self.tokens, gamma=self.gamma, gap=self.gap, families=self.families)
        if max(self.budgets) >= min(self.contexts):
            raise ValueError(f"budgets={self.budgets} must stay below the shortest context {min(self.contexts)}")

    def policies(self) -> dict:
        out: dict = {"full": None}
        for b in self.budgets:
            out.update(long_policies(b, tokens=self.tokens, gamma=self.gamma, gap=self.gap, families=self.families))
        return out

    def controls(self) -> dict[str, str]:
        return control_rows(self.policies()) if CONTROL in self.families else {}


def _config(lm, case, name: str, pol, tokens: int) -> dict:
    from kvlab.decode.keys import policy_dict
    from kvlab.studies.eviction.long_texts import digest

    return {"study": "evict_long", "version": STUDY_VERSION, "model": lm.name, "doc": case.doc,
            "context": case.context, "prompt_tokens": len(case.ctx), "tokens": tokens, "text": digest(case),
            "row": name, "policy": policy_dict(pol) if pol is not None else "full"}


def long_runs(lm, study: LongStudy, store, docs: Sequence[dict] | None = None, progress: bool = True,
              on_forward=None, stored_only: bool = False) -> pd.DataFrame:
    """Every (context, prompt, policy) of ``study``, stored in ``store`` (reruns resume); one row per run.
    ``docs``: the documents (default the shipped ``data/long_texts.jsonl``). ``stored_only``: run nothing; a
    prompt counts only when every row of it is stored (so contexts may end with different numbers of prompts)."""
    from kvlab.studies.eviction.long_policies import confkv_control
    from kvlab.studies.eviction.long_texts import cases, load_texts, position_limit

    docs = list(docs) if docs is not None else load_texts()
    pols, ctrl = study.policies(), study.controls()
    limit = position_limit(lm.model)
    rows = []
    for context in study.contexts:
        t_ctx = time.perf_counter()
        for i, case in enumerate(cases(lm.tokenizer, docs, context, study.tokens, study.prompts, limit)):
            t0 = time.perf_counter()
            done = {}
            for name, pol in pols.items():
                r = store.get(_config(lm, case, name, pol, study.tokens))
                if r is not None:
                    done[name] = r
            for a, c in ctrl.items():
                if a in done:
                    r = store.get(_config(lm, case, c, confkv_control(done[a]["mean_len"]), study.tokens))
                    if r is not None:
                        done[c] = r
            fresh = []
            if stored_only:
                if len(done) < len(pols) + len(ctrl):
                    _log(f"context {context} prompt {i + 1} ({case.doc}): {len(pols) + len(ctrl) - len(done)} rows "
                         "not stored: left out (--stored-only)", progress)
                    continue

            def put(name, pol, res, case=case, fresh=fresh):
                store.put(_config(lm, case, name, pol, study.tokens), res)
                fresh.append(name)

            got = run_prompt(lm.model, case, pols, control=ctrl, done=done, on_forward=on_forward, on_result=put)
            got = got or {n: (None, r) for n, r in done.items()}
            for name, (_, res) in got.items():
                rows.append({"context": context, "prompt_tokens": len(case.ctx), "prompt_idx": i, "doc": case.doc,
                             "policy": name, **{k: v for k, v in res.items() if not isinstance(v, list)}})
            _log(f"context {context} prompt {i + 1}/{study.prompts} ({case.doc}): {len(fresh)} rows run, "
                 f"{len(got) - len(fresh)} reused, {time.perf_counter() - t0:.1f} s", progress)
        _log(f"context {context} done in {(time.perf_counter() - t_ctx) / 60:.1f} min", progress)
    return pd.DataFrame(rows)


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[{time.strftime('%H:%M:%S')}] evict-long: {msg}", flush=True)
# pairs read in docs/eviction.md: row family -> the family it is compared with at the same budget
PARTNERS = {"confkv_l": CONTROL, "pyramidkv": "snapkv", "confkv_int8": "confkv_l", "h2o": "confkv_l",
            "streamingllm": "sliding"}
COLS = ["context", "policy", "family", "budget", "n_prompts", "prompt_tokens", "mean_len", "kv_mb16", "kl_forced",
        "kl_forced_lo", "kl_forced_hi", "baseline", "d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi",
        "d_kl_forced_mde", "partner", "d_kl_partner", "d_kl_partner_lo", "d_kl_partner_hi", "d_kl_partner_mde",
        "ppl", "gap_closed", "frac_loose", "frac_at_loose", "tok_s_b8"]


def split_name(name: str) -> tuple[str, float]:
    if name == "full":
        return "full", float("nan")
    fam, b = name.rsplit("_b", 1)
    return fam, float(b)


def _paired(g: pd.DataFrame, name: str, base: str, n_boot: int, rng) -> tuple[float, float, float, float]:
    """Mean paired difference of ``kl_forced`` (``name`` - ``base``, same prompts), its bootstrap 95 % interval
    (NaN below 5 pairs) and MDE (:func:`kvlab.core.metrics.mde`)."""
    from kvlab.core.metrics import mde
    from kvlab.harness.experiment import MIN_PAIRS

    a = g[g.policy == name].set_index("prompt_idx").kl_forced
    b = g[g.policy == base].set_index("prompt_idx").kl_forced
    idx = a.index.intersection(b.index)
    if not len(idx) or name == base:
        return (float("nan"),) * 4
    d = (a.loc[idx] - b.loc[idx]).to_numpy()
    if len(d) < MIN_PAIRS:
        return float(d.mean()), float("nan"), float("nan"), mde(d)
    boots = rng.choice(d, size=(n_boot, len(d)), replace=True).mean(1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(d.mean()), float(lo), float(hi), mde(d)


def long_table(per_run: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """One row per (policy, context): means over prompts, the KL's own interval (vs the full cache, whose KL is
    0), the paired difference to the sliding window of the same budget (``d_kl_forced*``) and to the row's
    partner (:data:`PARTNERS`, ``d_kl_partner*``), perplexity of the text's continuation and the share of the
    gap between a 512-entry sliding window and the full cache it closes."""
    rows = []
    if not len(per_run):
        return pd.DataFrame(columns=COLS)
    for context, g in per_run.groupby("context", sort=True):
        rng = np.random.default_rng(seed)
        ppl = {n: perplexity(float(x.nll.mean())) for n, x in g.groupby("policy")}
        slid = sorted(int(split_name(n)[1]) for n in ppl if n.startswith("sliding_b"))
        ref_b = REFERENCE if REFERENCE in slid else (slid[-1] if slid else REFERENCE)
        ref = ppl.get(row_name("sliding", ref_b), float("nan"))
        for name, x in g.groupby("policy", sort=False):
            fam, budget = split_name(name)
            kl = x.kl_forced.to_numpy(dtype=float)
            if len(kl) >= 5 and name != "full":
                klb = rng.choice(kl, size=(n_boot, len(kl)), replace=True).mean(1)
                klo, khi = (float(v) for v in np.percentile(klb, [2.5, 97.5]))
            else:
                klo = khi = float("nan")
            base = row_name("sliding", int(budget)) if fam not in ("full", "sliding") else ""
            d = _paired(g, name, base, n_boot, rng) if base else (float("nan"),) * 4
            partner = row_name(PARTNERS[fam], int(budget)) if fam in PARTNERS else ""
            dp = _paired(g, name, partner, n_boot, rng) if partner else (float("nan"),) * 4
            gap = ref - ppl["full"] if "full" in ppl else float("nan")
            rows.append({"context": context, "policy": name, "family": fam, "budget": budget,
                         "n_prompts": len(x), "prompt_tokens": float(x.prompt_tokens.mean()),
                         "mean_len": float(x.mean_len.mean()), "kv_mb16": float(x.kv_bytes16.mean()) / 2 ** 20,
                         "kl_forced": float(kl.mean()), "kl_forced_lo": klo, "kl_forced_hi": khi,
                         "baseline": base, "d_kl_forced": d[0], "d_kl_forced_lo": d[1], "d_kl_forced_hi": d[2],
                         "d_kl_forced_mde": d[3], "partner": partner, "d_kl_partner": dp[0], "d_kl_partner_lo": dp[1],
                         "d_kl_partner_hi": dp[2], "d_kl_partner_mde": dp[3], "ppl": ppl[name],
                         "gap_closed": (ref - ppl[name]) / gap if gap == gap and gap != 0 else float("nan"),
                         # the control has no schedule (γ = 0): its budget is always its one budget
                         "frac_loose": float("nan") if fam == CONTROL else float(x.frac_loose.mean()),
                         "frac_at_loose": float("nan") if fam == CONTROL else float(x.frac_at_loose.mean())})
    out = pd.DataFrame(rows)
    order = {f: i for i, f in enumerate(("full",) + FAMILIES)}
    out["_o"] = [(c, 0 if f == "full" else 1, b if b == b else 0, order.get(f, len(order)))
                 for c, f, b in zip(out.context, out.family, out.budget)]
    out = out.sort_values("_o", kind="stable").reset_index(drop=True)
    return out.reindex(columns=COLS)


def long_notes(study: LongStudy) -> list[str]:
    return [
        f"Long-context eviction (`python -m kvlab evict-long`): each prompt is a {'/'.join(map(str, study.contexts))}"
        "-token excerpt of a real document (data/long_texts.jsonl; provenance and licenses in "
        "data/long_texts_source.py), prefilled ONCE per attention-statistics setting with the full cache; every "
        "policy branches from a copy of that prefill.",
        f"One teacher-forced pass per policy on the TEXT's own next {study.tokens} tokens (not the full cache's greedy "
        "continuation): `kl_forced` = mean KL(full ‖ policy) in nats over steps 2..M (step 1 reads the whole "
        "context for every policy), `ppl` = exp(mean NLL of the text's tokens) over the same steps and prompts.",
        "`mean_len`: live entries the scored forwards read (mean over layers and steps); `kv_mb16`: resident K/V "
        "MiB at 16 bits (INT8 entries of confkv_l / confkv_int8 at 1 byte); `prompt_tokens`: the context actually "
        "fed (8,192 positions hold the context and the continuation).",
        "`kl_forced_lo/_hi`: bootstrap 95 % interval of the mean KL over prompts (the paired difference to the "
        "full cache, whose KL is 0). `d_kl_forced*`: paired difference to the SLIDING WINDOW OF THE SAME BUDGET "
        "(`baseline`), bootstrap 95 % interval and MDE (80 % power); negative = closer to the full cache than "
        "the window. `d_kl_partner*`: the same against `partner` (Conf-KV-L vs its confidence-off control, "
        "PyramidKV vs SnapKV, confkv_int8 vs Conf-KV-L, H2O vs Conf-KV-L, StreamingLLM vs sliding).",
        f"`gap_closed` = (ppl(sliding_b{REFERENCE}) - ppl) / (ppl(sliding_b{REFERENCE}) - ppl(full)) at the same "
        "context: the Conf-KV paper's measure (74 % for Conf-KV-L on GPT-2 in the paper).",
        f"Conf-KV rows: loose = budget, tight = budget - {study.gap}, γ = {study.gamma:g}; `frac_loose`: share of "
        "cuts choosing the loose budget, `frac_at_loose`: share where the cache (mean over layers) stood at it. "
        "confkv_l_fixed: Conf-KV-L's ranker, pyramid and INT8 storage at one fixed budget = Conf-KV-L's mean "
        "length on the same prompt (γ = 0).",
    ]
