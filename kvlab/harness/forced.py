"""Teacher-forced scores of a decode config (issue 27: a score loops can't fool): every decoder scored on the
*same* tokens, a fixed reference continuation per prompt (the teacher's own sampled continuation, stored once),
fed teacher-forced while the decoder is conditioned as its mode says. Part of the experiment harness: the
baselines, refresh, eviction and training studies all add these columns (:func:`forced_columns`).
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd
import torch

from kvlab.cache import KVCache
from kvlab.decode import Decoding, DecodeConfig, Sampling, run
from kvlab.core.metrics import kl_rows, teacher_logprobs
from kvlab.store import RunStore

# --------------------------------------------------------------------------- forced scores of a decode config
#
# Issue 27: a score loops can't fool. Teacher-PPL and on-path KL score each decoder on the text it
# wrote itself, and a decoder stuck in a loop writes text the teacher finds easy to predict (a
# repeated phrase is cheap once seen), so a looping decoder can win on both. Here every decoder is
# scored on the *same* tokens: a fixed reference continuation per prompt (the teacher's own sampled
# continuation, stored once), fed to the decoder teacher-forced while it is conditioned exactly as
# its mode says (OverFill: the teacher's prefill of x, its own entries over y; student: its own
# prefill; refresh: the teacher rewrites the cache at the policy's steps on the forced path).

FORCED_SCORE_NOTE = ("`kl_forced`: mean KL(p_T‖q) in nats over a fixed reference continuation per prompt (the teacher's "
                     "own sampled continuation, stored once), each decoder fed those tokens teacher-forced and conditioned "
                     "as its mode says (OverFill: teacher prefill of the prompt; student: its own; refresh: at the "
                     "policy's steps on the forced path); averaged over steps 2..N in every row (the same N−1 steps "
                     "for every decoder; a step whose distribution the teacher gave counts at KL 0); `nll_forced`: the "
                     "decoder's mean NLL of the reference over the same steps; neither rewards loops. Step 1 (the "
                     "prefill's prediction: the teacher's own in OverFill rows, KL 0) is its own column, "
                     "`kl_forced_step1` / `nll_forced_step1`.")
FORCED_COST_NOTE = ("`refreshes_forced` / `teacher_tokens_forced`: the refreshes the policy's own schedule fired on the "
                    "forced path (the teacher's reference text) and the teacher tokens it read there (refresh prefills "
                    "+ probes), per run — what `kl_forced` cost, beside the free runs' `refreshes` / `teacher_tokens`.")
# The first step ``kl_forced`` / ``nll_forced`` average from (1-based): step 1 is the prefill's prediction, the
# teacher's own in OverFill rows (KL 0, and the one step the OverFill decoder is never trained on) but the
# student's in student rows; averaging from step 2 scores every row on the same N−1 steps (issue 37).
FORCED_FIRST_STEP = 2
# Part of every stored forced score's key: bumped whenever what a stored score means changes, so a store
# holding scores of an older definition recomputes them instead of reusing them (1: steps 2..N, step 1 apart).
FORCED_SCORE_VERSION = 1
FORCED_STEP_COLUMNS = ("kl_forced_step1", "nll_forced_step1")
# What the forced path's own refresh schedule cost on the teacher's text (issue 37; :func:`forced_costs`).
FORCED_COST_COLUMNS = ("refreshes_forced", "teacher_tokens_forced")
DISTINCT_NOTE = "`distinct2`: distinct bigrams / bigrams of the generated text (1 = no repeated bigram; loops pull it down)."


def reference_tokens(teacher, prompt: str, tokens: int, sampling, store: RunStore, chat: bool = True) -> list[int]:
    """The teacher's own sampled continuation of ``prompt`` (``tokens`` long, EOS ignored), stored once per
    (teacher, prompt, length, sampling) — whatever student a table pairs it with."""
    cfg = _reference_key(teacher, prompt, tokens, sampling, chat)

    def compute():
        tr = run(teacher, None, prompt, DecodeConfig(mode="teacher", max_new_tokens=tokens, sampling=sampling,
                                                     chat=chat))
        return {"tokens": tr.tokens, "text": tr.text}

    return list(store.get_or_run(cfg, compute)["tokens"])


def _reference_key(teacher, prompt: str, tokens: int, sampling, chat: bool) -> dict:
    from dataclasses import asdict

    return {"kind": "reference", "teacher": teacher.fingerprint, "prompt": prompt, "tokens": tokens,
            "sampling": asdict(sampling), "chat": chat}


def reference_tokens_many(teacher, prompts, tokens: int, samplings, store: RunStore, chat: bool = True,
                          batch: int | None = None) -> list[list[int]]:
    """:func:`reference_tokens` of every prompt (``samplings[i]`` for prompt ``i``), the missing ones decoded
    ``batch`` at a time in one batched teacher run (:func:`kvlab.decode.run_batch`; each row seeded from its
    own sampling, so a row's tokens do not depend on its batch) and stored under the same key as one at a time."""
    from kvlab.decode import run_batch
    from kvlab.harness.experiment import check_batch

    batch = check_batch(batch)
    if len(samplings) != len(prompts):
        raise ValueError(f"samplings has {len(samplings)} entries for {len(prompts)} prompts (one per prompt)")
    keys = [_reference_key(teacher, p, tokens, s, chat) for p, s in zip(prompts, samplings)]
    got = [store.reused(k) for k in keys]
    miss = [j for j, g in enumerate(got) if g is None]
    for k in range(0, len(miss), batch):
        chunk = miss[k:k + batch]
        cfgs = [DecodeConfig(mode="teacher", max_new_tokens=tokens, sampling=samplings[j], chat=chat) for j in chunk]
        traces = run_batch(teacher, None, [prompts[j] for j in chunk], cfgs)
        for j, tr in zip(chunk, traces):
            got[j] = store.get_or_run(keys[j], lambda tr=tr: {"tokens": tr.tokens, "text": tr.text})
    return [list(g["tokens"]) for g in got]


class ForcedDecoding(Decoding):
    """The decode loop (:class:`kvlab.decode.Decoding`) with every token forced to ``reference[t]``
    instead of chosen: prefill, probe, refresh and eviction phases run as in a free-running decode
    (a policy sees the forced path's records); only the choice is overridden. Records keep
    ``source`` (who produced each distribution) and ``dists`` the decoder's log-distributions
    ``q_t`` — the step-by-step reference :func:`forced_dists` must match."""

    def __init__(self, teacher, student, prompt: str, config: DecodeConfig, reference):
        ref = [int(t) for t in reference]
        if len(ref) < config.max_new_tokens:
            raise ValueError(f"reference holds {len(ref)} tokens; max_new_tokens={config.max_new_tokens} needs as many")
        super().__init__(teacher, student, prompt, replace(config, keep_dists=True, sampling=Sampling(),
                                                           ignore_eos=True))
        self._ref = ref

    def _score(self, step, logits, source, stats=None):
        rec = super()._score(step, logits, source, stats)   # greedy choice, then overridden
        tok = self._ref[step - self.first_step]
        self.tokens[-1] = tok
        return replace(rec, token_id=tok, token=self.decoder.tokenizer.decode([tok]), logprob=float(self.dists[-1][tok]))


def _fast_path(config) -> bool:
    """Configs :func:`forced_scores` computes in a few batched forwards: no eviction, and no refresh or
    a fixed-schedule full refresh (``Periodic(T)`` with no window, ``refresh_next="rerun"``)."""
    from kvlab.refresh.policies import Periodic

    if config.evict is not None or config.rebuild_student_cache:
        return False
    pol = config.refresh
    return pol is None or (type(pol) is Periodic and pol.W is None and config.refresh_next == "rerun")


def forced_dists(teacher, student, prompt: str, config, reference) -> tuple[torch.Tensor, list[str]]:
    """``(q, sources)``: the decoder's log-distributions ``(N, V)`` over the reference tokens (row ``t``:
    ``log q(· | x, y_<t)`` under ``config``'s conditioning) and which model produced each row
    (:func:`_forced_run` without its costs)."""
    q, sources, _ = _forced_run(teacher, student, prompt, config, reference)
    return q, sources


def forced_costs(records) -> dict:
    """What the forced path's own refresh schedule cost, from its records (:func:`kvlab.harness.costs.run_costs`
    on the teacher's reference text): ``refreshes_forced``, ``teacher_tokens_forced`` (refresh prefills +
    probe tokens the teacher read) and ``probe_tokens_forced``."""
    from kvlab.harness.costs import run_costs

    c = run_costs(records)
    return {"refreshes_forced": c["refreshes"], "teacher_tokens_forced": c["teacher_tokens"],
            "probe_tokens_forced": c["probe_tokens"]}


def _fast_costs(config) -> dict:
    """:func:`forced_costs` of a fast-path config (:func:`_fast_path`) without its records: ``Periodic(T)``
    refreshes after every step ``r`` < N with ``r % T == 0``, and the teacher, which keeps its own cache, reads
    ``y_1 .. y_r`` up to the last one (the prompt's prefill is not counted, as in a free run); no probes."""
    pol, N = config.refresh, config.max_new_tokens
    steps = [] if pol is None else [r for r in range(1, N) if r % pol.T == 0]
    return {"refreshes_forced": len(steps), "teacher_tokens_forced": max(steps, default=0), "probe_tokens_forced": 0}


@torch.inference_mode()
def _forced_run(teacher, student, prompt: str, config, reference) -> tuple[torch.Tensor, list[str], dict]:
    """``(q, sources, costs)``: :func:`forced_dists`' distributions and sources, and :func:`forced_costs`.

    Fast path (see :func:`_fast_path`): teacher → one teacher forward; student → its prefill of ``x`` and
    one forward over ``y_<N``; OverFill → the teacher's prefill of ``x`` (row 1 is ``p_T``) and one
    student forward over ``y_<N``; ``Periodic(T)`` → after each refresh at step ``r`` the cache over
    ``x, y_<r`` is the teacher's (what a full "rerun" refresh leaves), and the student reads
    ``y_r … `` in one forward until the next refresh. Anything else runs :class:`ForcedDecoding`
    step by step."""
    N = config.max_new_tokens
    y = [int(t) for t in reference[:N]]
    if len(y) < N:
        raise ValueError(f"reference holds {len(reference)} tokens; max_new_tokens={N} needs as many")
    if not _fast_path(config):
        d = ForcedDecoding(teacher, student, prompt, config, y)
        recs = list(d)
        return torch.stack(d.dists).float(), [r.source for r in recs], forced_costs(recs)
    probe = Decoding(teacher, student, prompt, config)       # validates; knows who prefills and decodes
    x = list(probe.prompt_ids)
    if config.mode == "teacher":
        return teacher_logprobs(teacher, x, y), ["teacher"] * N, _fast_costs(config)
    model = student.model
    if config.mode == "student":
        cache, first = KVCache.prefill(model, x, writer="student")
        src0 = "student"
    else:
        cache, first = KVCache.prefill(teacher.model, x, writer="teacher")
        src0 = "teacher"
    rows, sources = [torch.log_softmax(first.float(), -1).cpu().reshape(1, -1)], [src0]
    pol = config.refresh
    # refresh steps r (never after the last step): the student then reads y_r.. on a teacher-written x, y_<r
    refresh = [r for r in range(1, N) if pol is not None and r % pol.T == 0]
    bounds = [1] + refresh + [N]            # segment k: rows q_{b_k + 1} .. q_{b_{k+1}}, fed y_{b_k} .. y_{b_{k+1}-1}
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        if a == b:
            continue
        if k > 0:                            # a refresh after step a: teacher cache over x, y_<a
            cache, _ = KVCache.prefill(teacher.model, x + y[:a - 1], writer="teacher")
        q = cache.forward(model, y[a - 1:b - 1], writer="student", logits="all")   # (b - a, V)
        q = q.reshape(b - a, -1)
        rows.append(torch.log_softmax(q.float(), -1).cpu())
        sources += ["student"] * (b - a)
    return torch.cat(rows)[:N], sources[:N], _fast_costs(config)


def forced_scores(teacher, student, prompt: str, config, reference) -> dict:
    """``kl_forced`` / ``nll_forced`` of one decode config on the reference tokens, plus the per-step KL.
    Averages run over steps 2..N for every config (:data:`FORCED_FIRST_STEP`): the same steps in every row of a
    table, whoever produced step 1's distribution (the teacher's prefill in OverFill, the student's own
    prefill in student mode). Step 1 is reported alone as ``kl_forced_step1`` / ``nll_forced_step1``."""
    N = config.max_new_tokens
    y = [int(t) for t in reference[:N]]
    q, sources, costs = _forced_run(teacher, student, prompt, config, y)
    return _scores(teacher, prompt, config, y, q, sources, costs)


def _scores(teacher, prompt: str, config, y: list[int], q: torch.Tensor, sources: list[str], costs: dict) -> dict:
    """:func:`forced_scores` from the decoder's log-distributions ``q`` ``(N, V)`` over ``y``, their sources and
    the forced path's own costs (:func:`forced_costs`)."""
    N = config.max_new_tokens
    x = teacher.encode_prompt(prompt, chat=config.chat)
    p = teacher_logprobs(teacher, x, y)                                   # (N, V)
    kl = kl_rows(p, q)
    if len(sources) != N or q.shape[0] != N:
        raise ValueError(f"{q.shape[0]} distributions / {len(sources)} sources for max_new_tokens={N} (one per step)")
    kl = torch.where(torch.tensor([s == "teacher" for s in sources]), torch.zeros_like(kl), kl) \
        if config.evict is None else kl
    nll = -q[torch.arange(N), torch.tensor(y)]
    k = FORCED_FIRST_STEP - 1                 # index of step 2: steps 2..N, the same in every row
    if N <= k:
        raise ValueError(f"max_new_tokens={N}: the forced scores average steps {FORCED_FIRST_STEP}..N; "
                         f"pass max_new_tokens >= {FORCED_FIRST_STEP}")
    return {"kl_forced": float(kl[k:].mean()), "nll_forced": float(nll[k:].mean()), "forced_steps": N - k,
            "kl_forced_step1": float(kl[0]), "nll_forced_step1": float(nll[0]), **costs, "kl_forced_steps": kl.tolist()}


def forced_scores_many(teacher, student, items, batch: int | None = None, on_result=None) -> list[dict]:
    """:func:`forced_scores` of every ``(prompt, config, reference)`` in ``items`` (results in order).
    Fast-path configs (:func:`_fast_path`) take their few forwards each; the rest are decoded step by step
    ``batch`` rows at a time (:class:`kvlab.decode.BatchDecoding` with ``config.forced`` = the reference:
    every phase runs on the forced path, as :class:`ForcedDecoding` runs it alone), rows grouped by mode.
    A row's scores do not depend on its batch (float tolerance, as for free-running batched runs).
    ``on_result(j, scores)`` is called as soon as item ``j`` is scored (e.g. to store it)."""
    from kvlab.decode import BatchDecoding
    from kvlab.harness.experiment import check_batch

    batch = check_batch(batch)
    out: list[dict | None] = [None] * len(items)
    slow: dict[str, list[int]] = {}
    for j, (prompt, config, ref) in enumerate(items):
        if batch == 1 or _fast_path(config):
            out[j] = forced_scores(teacher, student, prompt, config, ref)
            if on_result is not None:
                on_result(j, out[j])
        else:
            slow.setdefault(config.mode, []).append(j)
    for idx in slow.values():
        for k in range(0, len(idx), batch):
            chunk = idx[k:k + batch]
            ys, cfgs = [], []
            for j in chunk:
                prompt, config, ref = items[j]
                y = [int(t) for t in ref[:config.max_new_tokens]]
                if len(y) < config.max_new_tokens:
                    raise ValueError(f"items[{j}]: reference holds {len(ref)} tokens; max_new_tokens="
                                     f"{config.max_new_tokens} needs as many")
                ys.append(y)
                cfgs.append(replace(config, forced=tuple(y), keep_dists=True, sampling=Sampling(), ignore_eos=True))
            bd = BatchDecoding(teacher, student, [items[j][0] for j in chunk], cfgs)
            recs: list[list] = [[] for _ in chunk]
            for b, rec in bd:
                recs[b].append(rec)
            if bd.errors:
                b, e = next(iter(bd.errors.items()))
                raise RuntimeError(f"forced scoring failed on items[{chunk[b]}]: {e}") from e
            for b, j in enumerate(chunk):
                q = torch.stack(bd.rows[b].dists).float()
                out[j] = _scores(teacher, items[j][0], cfgs[b], ys[b], q, [r.source for r in recs[b]],
                                 forced_costs(recs[b]))
                if on_result is not None:
                    on_result(j, out[j])
    return out


def distinct_n(tokens, n: int = 2) -> float:
    """Distinct n-grams / n-grams of ``tokens`` (1.0 = no repeats; NaN for fewer than ``n`` tokens)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return float("nan") if not grams else len(set(grams)) / len(grams)


def forced_columns(teacher, students, spec, policies: dict, store: RunStore, progress: bool = False) -> pd.DataFrame:
    """Per (policy, prompt): ``kl_forced``, ``nll_forced`` (steps 2..N), ``kl_forced_step1``, ``nll_forced_step1``,
    the forced path's own ``refreshes_forced`` / ``teacher_tokens_forced`` (stored under the reference's hash and
    :data:`FORCED_SCORE_VERSION`) and ``distinct2`` of the stored free-running run. ``students``: one model, or a dict policy → model
    (e.g. the ``standalone`` row decodes with another student). The references and the missing scores
    are computed in batches of ``spec.batch`` rows (:func:`reference_tokens_many`, :func:`forced_scores_many`)."""
    import hashlib

    from kvlab.harness.experiment import scored_run, stored_config

    refs = reference_tokens_many(teacher, spec.prompts, spec.tokens, [spec.sampling_for(i) for i in range(len(spec.prompts))],
                                 store, batch=spec.batch)
    jobs = []                                   # (prompt index, policy, student, config, store key)
    for i, prompt in enumerate(spec.prompts):
        h = hashlib.sha256(str(refs[i]).encode()).hexdigest()[:16]
        for name, cfg in policies.items():
            st = students.get(name) if isinstance(students, dict) else students
            cfg = replace(cfg, max_new_tokens=spec.tokens, sampling=spec.sampling_for(i))
            key = {"kind": "forced_score", "score_version": FORCED_SCORE_VERSION, "teacher": teacher.fingerprint,
                   "student": None if st is None else st.fingerprint, "prompt": prompt,
                   "decode": replace(cfg, sampling=Sampling()).to_dict(), "reference": h, "ref_tokens": spec.tokens}
            jobs.append((i, name, st, cfg, key))
    got = [store.reused(k) for *_, k in jobs]
    by_student: dict[int, list[int]] = {}
    for j, g in enumerate(got):
        if g is None:
            by_student.setdefault(id(jobs[j][2]), []).append(j)
    for idx in by_student.values():
        st = jobs[idx[0]][2]
        if progress:
            print(f"forced: {len(idx)} scores to compute (batches of {spec.batch or 'default'})", flush=True)
        def stored(k: int, r: dict, idx=idx) -> None:      # each score is stored as soon as it is computed
            got[idx[k]] = store.get_or_run(jobs[idx[k]][4], lambda: r)

        forced_scores_many(teacher, st, [(spec.prompts[jobs[j][0]], jobs[j][3], refs[jobs[j][0]]) for j in idx],
                           batch=spec.batch, on_result=stored)
    rows = []
    for (i, name, st, cfg, key), res in zip(jobs, got):
        prompt = spec.prompts[i]
        run_ = store.get(stored_config(teacher, st, prompt, cfg))        # the table's free run (not counted)
        if run_ is None:
            run_ = scored_run(teacher, st, prompt, cfg, store)
        toks = run_["steps"]["token_id"]
        rows.append({"policy": name, "prompt_idx": i, "kl_forced": res["kl_forced"], "nll_forced": res["nll_forced"],
                     **{c: res[c] for c in FORCED_STEP_COLUMNS + FORCED_COST_COLUMNS}, "distinct2": distinct_n(toks, 2)})
    return pd.DataFrame(rows)
