"""Passkey retrieval ("needle in a haystack") under KV-cache eviction (seed 002 "NIAH").
Its runs go through the run store; the tables are returned to the caller that writes them.

The task is the classic passkey prompt (Mohtashami & Jaggi, 2023): an instruction, repeated
filler sentences, one needle sentence ``"The pass key is 71432. Remember it. 71432 is the pass
key."`` at a chosen depth, and the question ``"What is the pass key? The pass key is"``. The model
completes it greedily; the answer is the first run of digits in the completion (:func:`parse_key`)
and counts only if it equals the key exactly.

Format choice, measured on the embedded SmolLM2-135M-Instruct with the full cache (docs/eviction.md,
"Passkey retrieval"): the raw completion prompt (``chat=False``) retrieves the key at every
depth up to ~1k prompt tokens; with the chat template the model restates the question and needs
many more tokens; at 2k–4k tokens the full cache already misses some depths. The default grid
therefore stays at 256–1,024 tokens, where the full cache succeeds, so that a miss under eviction
measures the policy and not the model.

Two settings (column ``setting`` of the tables):

* ``prefill`` — the whole prompt, question included, is prefilled; the policy prunes the cache
  after the first emitted token (decided on the full cache), so every later digit of the answer is
  read from the pruned cache. A real deployment pattern, but the policy never sees the question
  arrive and Conf-KV's budget meets only the answer.
* ``streamed`` — the haystack is prefilled and the question is fed through the decode loop
  teacher-forced (``DecodeConfig.forced``): every question token is one decode step, so the
  policy, its confidence and its budget act while the question arrives (and its attention
  statistics see the question's queries), then the answer is decoded greedily.

Memory is matched on the MEAN cache length over the decode steps, per setting: Conf-KV runs
first and every fixed-budget family gets the budget that gives the same mean
(:func:`matched_needle_policies`).

``depth`` is the fraction of the filler that precedes the needle: 0 = right after the
instruction (oldest), 1 = right before the question (newest). ``from_query`` states the same
unambiguously as the paper does: the number of prompt tokens between the end of the needle
sentence and the question.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from kvlab.decode import DecodeConfig, Sampling, run
from kvlab.harness.experiment import run_config
from kvlab.store import RunStore

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
KEY_DIGITS = 5
ANSWER_TOKENS = 8     # " " + 5 digits + "." and one spare: enough for any 5-digit answer

LENGTHS = (256, 512, 1024)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class NeedleCase:
    """One passkey prompt: target length (prompt tokens), needle depth, the key, the text."""

    length: int
    depth: float
    key: str
    prompt: str
    rep: int = 0
    from_query: int = -1          # prompt tokens between the needle sentence and the question (distance from query)

    @property
    def haystack(self) -> str:
        """The prompt without its question (what the ``streamed`` setting prefills)."""
        return self.prompt[: len(self.prompt) - len(QUESTION)]

    def __post_init__(self):
        if not 0.0 <= self.depth <= 1.0:
            raise ValueError(f"depth={self.depth!r} must be in [0, 1] (fraction of filler before the needle)")
        if not (self.key.isdigit() and len(self.key) == KEY_DIGITS):
            raise ValueError(f"key={self.key!r} must be a {KEY_DIGITS}-digit string")


def parse_key(text: str) -> str | None:
    """The first run of digits in a completion (``" 71432. The"`` → ``"71432"``), or None."""
    m = _DIGITS.search(text or "")
    return m.group() if m else None


def is_correct(text: str, key: str) -> bool:
    """Exact retrieval: the first digit run equals the key (a longer or shorter number is wrong)."""
    return parse_key(text) == key


def digits_correct(text: str, key: str) -> float:
    """Fraction of the key's digits reproduced in place (graded companion to :func:`is_correct`)."""
    got = parse_key(text) or ""
    return sum(a == b for a, b in zip(got, key)) / len(key)


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def build_case(tokenizer, length: int, depth: float, key: str, rep: int = 0) -> NeedleCase:
    """A passkey prompt of about ``length`` tokens (whole filler sentences, so within one filler
    unit of the target) with the needle after ``round(depth * units)`` filler units."""
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length={length!r} must be a positive int (prompt tokens)")
    fixed = _n_tokens(tokenizer, INTRO + NEEDLE.format(key=key) + QUESTION)
    unit = _n_tokens(tokenizer, FILLER)
    units = max(1, round((length - fixed) / unit))
    before = round(depth * units)
    prompt = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before) + QUESTION
    after = _n_tokens(tokenizer, FILLER * (units - before)) - _n_tokens(tokenizer, "") if units > before else 0
    return NeedleCase(length=length, depth=float(depth), key=key, prompt=prompt, rep=rep, from_query=after)


def make_cases(tokenizer, lengths: Sequence[int] = LENGTHS, depths: Sequence[float] = DEPTHS,
               reps: int = 1, seed: int = 0) -> list[NeedleCase]:
    """The grid: every (length, depth) with ``reps`` different keys (seeded, reproducible)."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps <= 0:
        raise ValueError(f"reps={reps!r} must be a positive int (keys per grid cell)")
    if not lengths or not depths:
        raise ValueError("lengths and depths must each hold at least one value")
    rng = random.Random(seed)
    cases = []
    for n in lengths:
        for d in depths:
            for r in range(reps):
                key = str(rng.randint(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS - 1))
                cases.append(build_case(tokenizer, int(n), float(d), key, rep=r))
    return cases


SETTINGS = ("streamed", "prefill")


def question_ids(lm, case: NeedleCase) -> list[int]:
    """The question's token ids as they follow the haystack in the whole prompt's tokenization."""
    full, hay = lm.encode_prompt(case.prompt, chat=False), lm.encode_prompt(case.haystack, chat=False)
    if full[: len(hay)] == hay:
        return full[len(hay):]
    return [int(i) for i in lm.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]]


def needle_config(evict=None, forced: tuple = ()) -> DecodeConfig:
    """Greedy raw completion on the teacher (the format that works at full cache, see module doc);
    ``forced``: the question's tokens, teacher-forced through the loop before the answer."""
    return DecodeConfig(mode="teacher", max_new_tokens=ANSWER_TOKENS + len(forced), sampling=Sampling(), chat=False,
                        evict=evict, forced=tuple(forced))


def _needle_job(lm, case: NeedleCase, evict, setting: str) -> tuple[str, DecodeConfig, dict, tuple]:
    """(prompt, config, store key, streamed question tokens) of one passkey completion."""
    if setting not in SETTINGS:
        raise ValueError(f"setting={setting!r} must be one of {SETTINGS}")
    forced = tuple(question_ids(lm, case)) if setting == "streamed" else ()
    prompt = case.haystack if setting == "streamed" else case.prompt
    cfg = needle_config(evict, forced)
    return prompt, cfg, run_config(lm, None, prompt, cfg, extra={"task": "needle"}), forced


def _needle_result(lm, tr, forced: tuple) -> dict:
    steps = tr.records
    answer = lm.tokenizer.decode(tr.tokens[len(forced):], skip_special_tokens=True)
    return {"text": answer, "prompt_tokens": len(tr.prompt_ids) + len(forced), "question_steps": len(forced),
            "cache_len": [r.cache_len for r in steps], "cache_bytes": [r.cache_bytes for r in steps],
            "evicted_steps": [r.evicted for r in steps],
            "budget": [r.signals.get("budget") for r in steps],
            "confidence": [r.signals.get("confidence") for r in steps],
            "evicted": sum(r.evicted for r in steps), "total_s": tr.total_s}


def needle_run(lm, case: NeedleCase, evict, store: RunStore, setting: str = "prefill") -> dict:
    """One stored passkey completion under ``evict`` (a policy or None = full cache) in ``setting``
    (module docstring). ``text`` is the answer only (after the streamed question)."""
    prompt, cfg, config, forced = _needle_job(lm, case, evict, setting)
    return store.get_or_run(config, lambda: _needle_result(lm, run(lm, None, prompt, cfg), forced))


def needle_results(lm, jobs: Sequence[tuple[NeedleCase, object]], store: RunStore, setting: str = "prefill",
                   batch: int | None = None, progress: bool = False) -> list[dict]:
    """:func:`needle_run` of every ``(case, evict)`` in ``jobs`` (results in order): stored ones are reused,
    the missing ones decoded ``batch`` at a time (:func:`kvlab.decode.run_batch`: one batched forward per
    step, each row prefilled and evicting on its own) and stored under the key one run alone has."""
    from tqdm.auto import tqdm

    from kvlab.decode import run_batch
    from kvlab.harness.experiment import check_batch

    batch = check_batch(batch)
    specs = [_needle_job(lm, case, pol, setting) for case, pol in jobs]
    got = [store.reused(k) for _, _, k, _ in specs]
    miss = [j for j, g in enumerate(got) if g is None]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(miss), disable=not progress, desc=f"needle {setting}",
               unit="run")
    for k in range(0, len(miss), batch):
        chunk = miss[k:k + batch]
        traces = run_batch(lm, None, [specs[j][0] for j in chunk], [specs[j][1] for j in chunk])
        for j, tr in zip(chunk, traces):
            got[j] = store.get_or_run(specs[j][2], lambda tr=tr, j=j: _needle_result(lm, tr, specs[j][3]))
            bar.update()
    bar.close()
    return got


def needle_row(name: str, case: NeedleCase, res: dict, setting: str) -> dict:
    lens = res["cache_len"]
    q = res.get("question_steps", 0)
    conf = [c for c in res.get("confidence", [])[q:] if c is not None]
    return {"setting": setting, "policy": name, "length": case.length, "depth": case.depth,
            "from_query": case.from_query, "rep": case.rep, "key": case.key, "prompt_tokens": res["prompt_tokens"],
            "answer": parse_key(res["text"]) or "", "correct": float(is_correct(res["text"], case.key)),
            "digits": digits_correct(res["text"], case.key), "mean_cache_len": sum(lens) / len(lens),
            "answer_cache_len": sum(lens[q:]) / max(1, len(lens) - q), "question_steps": q,
            "question_evicted": sum(res.get("evicted_steps", [0] * len(lens))[:q]),
            "answer_confidence": sum(conf) / len(conf) if conf else float("nan"),
            "evicted": res["evicted"], "total_s": res["total_s"]}


def needle_runs(lm, cases: Sequence[NeedleCase], policies: dict, store: RunStore, progress: bool = True,
                setting: str = "prefill", batch: int | None = None) -> pd.DataFrame:
    """Every (case, policy) completion in ``setting`` as one row: answer, correct, cache while answering
    (missing runs decoded ``batch`` at a time, :func:`needle_results`)."""

    jobs = [(c, name, pol) for c in cases for name, pol in policies.items()]
    res = needle_results(lm, [(c, pol) for c, _, pol in jobs], store, setting, batch=batch, progress=progress)
    return pd.DataFrame([needle_row(name, case, r, setting) for (case, name, _), r in zip(jobs, res)])


def matched_needle_runs(lm, cases: Sequence[NeedleCase], budget: int, store: RunStore, gamma: float = 0.9,
                        settings: Sequence[str] = SETTINGS, progress: bool = True,
                        batch: int | None = None, kvpress: Sequence[str] = ()) -> tuple[pd.DataFrame, dict]:
    """Both settings at matched mean memory: per setting, the full cache and Conf-KV first, then every
    fixed-budget family at the budget giving Conf-KV's mean cache length (:func:`matched_needle_policies`).
    ``kvpress``: kvpress press class names run beside them (decode-time eviction at the sliding window's
    budget, 4 sinks: :func:`matched_needle_policies`). Returns the per-run frame and, per setting, the policies
    used."""
    frames, used = [], {}
    for setting in settings:
        first = {"full": None, "confkv": needle_confkv(budget, gamma)}
        head = needle_runs(lm, cases, first, store, progress, setting, batch=batch)
        steps = ANSWER_TOKENS + (int(head.question_steps.max()) if setting == "streamed" else 0)
        target = float(head[head.policy == "confkv"].mean_cache_len.mean())
        rest = matched_needle_policies(target, steps, budget, kvpress=kvpress)
        frames += [head, needle_runs(lm, cases, rest, store, progress, setting, batch=batch)]
        used[setting] = {**first, **rest}
    return pd.concat(frames, ignore_index=True), used


def needle_confkv(budget: int, gamma: float = 0.9):
    """Conf-KV of the needle grid: ``tight = 3/4·budget`` on confident steps, ``loose = budget`` on
    uncertain ones, ``budget // 8`` protected, 4 sinks."""
    from kvlab.eviction import EVICTION_POLICIES

    return EVICTION_POLICIES.entry("confkv").at_budget(budget, gamma=gamma, tight_frac=0.75, recent=budget // 8, sinks=4)


def matched_needle_policies(mean_len: float, steps: int, budget: int, block_size: int = 4,
                            kvpress: Sequence[str] = ()) -> dict:
    """The fixed-budget families at the budget whose mean cache length over ``steps`` decode steps is
    ``mean_len`` (a prompt longer than the budget is cut at the first step): sliding (4 sinks), H2O
    (4 sinks, ``budget // 8`` recent) hold ``B`` from the first step on, so ``B = round(mean_len)``;
    block eviction sits in ``[max, max + bs - 1]``, mean ``max + (bs - 1)/2``; SnapKV cuts the prompt
    once to ``b`` and appends, mean ``b + (steps - 1)/2``. Each kvpress press named in ``kvpress``
    (``kvpress_<Class>``) evicts at every step to the sliding window's ``B`` with 4 sinks, as the sliding window
    holds it (:func:`kvlab.studies.kvpress.presses.policy`, decode mode)."""
    from kvlab.eviction import EVICTION_POLICIES as E

    b = max(budget // 8 + 6, round(mean_len))
    rec = budget // 8
    rb = max(1, rec // block_size)
    eb = max(1, round((mean_len - (block_size - 1) / 2) / block_size) - 1 - rb)
    snap = max(rec + 1, round(mean_len - (steps - 1) / 2))
    out = {"sliding": E.entry("sliding").at_budget(b, sinks=4), "h2o": E.entry("h2o").at_budget(b, recent=rec, sinks=4),
           "block": E.entry("block").at_budget(None, block_size=block_size, recent=rec, blocks=eb),
           "snapkv": E.entry("snapkv").at_budget(snap, recent=rec)}
    if kvpress:
        from kvlab.studies.kvpress.presses import make_press, policy

        out.update({f"kvpress_{name}": policy(make_press(name), "decode", b, 4) for name in kvpress})
    return out


def needle_table(per_run: pd.DataFrame, order: Sequence[str] | None = None) -> pd.DataFrame:
    """Accuracy per (setting, policy, length, depth): mean exact retrieval over keys, digits, cache length."""
    if "setting" not in per_run:
        per_run = per_run.assign(setting="prefill")
    if "from_query" not in per_run:
        per_run = per_run.assign(from_query=-1)
    if "mean_cache_len" not in per_run:
        per_run = per_run.assign(mean_cache_len=per_run.answer_cache_len)
    g = per_run.groupby(["setting", "policy", "length", "depth"], sort=False)
    out = g.agg(accuracy=("correct", "mean"), digits=("digits", "mean"), n=("correct", "size"),
                from_query=("from_query", "mean"), prompt_tokens=("prompt_tokens", "mean"),
                mean_cache_len=("mean_cache_len", "mean"),
                answer_cache_len=("answer_cache_len", "mean")).reset_index()
    if order is not None:
        out["_o"] = out.policy.map({p: i for i, p in enumerate(order)})
        out["_s"] = out.setting.map({s: i for i, s in enumerate(SETTINGS)})
        out = out.sort_values(["_s", "_o", "length", "depth"], kind="stable").drop(columns=["_o", "_s"])
        out = out.reset_index(drop=True)
    return out


def needle_markdown(table: pd.DataFrame) -> str:
    """Two pivots of the long table: accuracy by haystack length (mean over depths) and by depth."""
    from kvlab.harness.experiment import to_markdown

    if "setting" not in table:
        table = table.assign(setting="prefill")
    parts = []
    for setting in dict.fromkeys(table.setting):
        t = table[table.setting == setting]
        order = list(dict.fromkeys(t.policy))
        for col, label in (("length", "prompt tokens"), ("depth", "needle depth (0 = oldest)")):
            pv = t.pivot_table(index="policy", columns=col, values="accuracy", aggfunc="mean").loc[order]
            pv.columns = [f"{label.split(' (')[0]} {c:g}" for c in pv.columns]
            pv["mean"] = t.groupby("policy", sort=False)["accuracy"].mean().loc[order]
            if "mean_cache_len" in t:
                pv["mean cache"] = t.groupby("policy", sort=False)["mean_cache_len"].mean().loc[order]
            parts.append(f"Setting `{setting}`: exact passkey retrieval by {label} (mean over the other axis):\n\n"
                         + to_markdown(pv.reset_index(), floatfmt=".2f"))
    n = int(table.n.sum() / max(1, table.groupby(["setting", "policy"]).ngroups))
    from kvlab.harness.tableview import plural

    return "\n".join(parts) + f"\n{plural(n, 'prompt')} per policy; greedy; accuracy = exact 5-digit match.\n"


__all__ = ["NeedleCase", "build_case", "make_cases", "parse_key", "is_correct", "digits_correct", "needle_config",
           "needle_run", "needle_runs", "matched_needle_runs", "matched_needle_policies", "needle_confkv",
           "question_ids", "needle_table", "needle_markdown", "LENGTHS", "DEPTHS", "SETTINGS"]


def check_grid(lengths: Sequence[int], depths: Sequence[float], reps: int, budget: int) -> None:
    """Validate a needle grid before any model loads (ValueError naming the parameter)."""
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in lengths):
        raise ValueError(f"needle lengths={list(lengths)!r} must be positive ints (prompt tokens)")
    if not depths or any(not 0.0 <= float(d) <= 1.0 for d in depths):
        raise ValueError(f"needle depths={list(depths)!r} must lie in [0, 1] (0 = oldest, 1 = newest)")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps <= 0:
        raise ValueError(f"needle reps={reps!r} must be a positive int (keys per grid cell)")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 16:
        raise ValueError(f"needle budget={budget!r} must be an int >= 16 (cache entries)")
    if budget >= min(lengths):
        raise ValueError(f"needle budget={budget} must be smaller than the shortest needle length {min(lengths)}: "
                         "otherwise nothing is evicted and every policy equals the full cache")


def needle_policies(budget: int, gamma: float = 0.9, block_size: int = 16) -> dict:
    """Full cache and each eviction family at the same peak budget of ``budget`` entries.

    Sliding keeps 4 sinks + the newest entries; H2O and Conf-KV protect the newest ``budget // 4``;
    Conf-KV uses ``tight = budget // 2`` on confident steps and ``loose = budget`` otherwise; block
    eviction keeps one start block, ``budget // 4`` recent entries in blocks, and as many evictable
    blocks as fit with ``max + block_size - 1 <= budget`` (OpenVINO's semantics: the cache reaches
    ``max + block_size - 1`` before a whole block goes); SnapKV cuts the prompt to
    ``budget - ANSWER_TOKENS`` entries (observation window ``budget // 8``), so the answer's last step
    also sees at most ``budget``. PyramidKV keeps the same number *on average over layers* (the same
    total memory as SnapKV): its lower layers keep more than ``budget``, its upper layers fewer."""
    from kvlab.eviction import EVICTION_POLICIES as E

    rec = budget // 4
    rb = max(1, rec // block_size)
    eb = max(1, (budget - block_size + 1) // block_size - 1 - rb)
    return {"full": None,
            "sliding": E.entry("sliding").at_budget(budget, sinks=4),
            "h2o": E.entry("h2o").at_budget(budget, recent=rec),
            "confkv": E.entry("confkv").at_budget(budget, gamma=gamma, tight_frac=0.5, recent=rec),
            "block": E.entry("block").at_budget(None, block_size=block_size, recent=rec, blocks=eb),
            "snapkv": E.entry("snapkv").at_budget(budget - ANSWER_TOKENS, recent=budget // 8),
            "pyramidkv": E.entry("pyramidkv").at_budget(budget - ANSWER_TOKENS, recent=budget // 8)}
