"""Grid specs: which configs to run over which prompts, from a TOML file or CLI flags.

A spec (every table and key optional except what makes the grid non-empty)::

    name = "refresh-small"                  # default: the file's stem

    [prompts]
    file = "data/prompts.jsonl"             # JSON Lines with a "prompt" field (relative to this file or cwd)
    count = 8                               # the first `count` prompts (default 8)

    [run]
    modes = ["teacher", "student", "overfill"]
    tokens = 128                            # N; a list sweeps it
    student = "overfill"                    # student variant(s) (kvlab.sweep.students); a list sweeps it
    prune = "h0.20,i0.50"                   # the embedded student's prune shape(s); a list sweeps it
    repeats = 1                             # seeds per (config, prompt)
    refresh_next = ["rerun"]                # applied to configs with a refresh policy
    baseline = true                         # also run each mode without policies

    [sampling]
    temperature = 0.7                       # a list sweeps it
    top_p = 0.9
    seed = 0                                # prompt i, repeat r -> seed + i + 10000 r (paired across configs)

    [models]                                # default: the embedded pair
    kind = "embedded"                       # or "tiny" (random tiny models: tests, benchmarks of the machinery)
    teacher = "org/model-or-folder"         # instead of the embedded teacher (kind "embedded")
    student = "org/model-or-folder"
    device = "cpu"                          # default: CUDA when present
    dtype = "float32"

    [refresh.periodic]                      # one table per policy family (kvlab.sweep.families)
    T = [16, 32, 64]                        # list, scalar, or range
    [refresh.entropy]
    tau_bits = {start = 4, stop = 8, step = 1}   # inclusive range; or {start, stop, num}
    [evict.h2o]                             # eviction families (kvlab.eviction.EVICTION_POLICIES)
    budget = [64, 128]

Every value of every family is expanded (Cartesian product within a family), every policy object
is constructed, and every prompt is read *before* any model loads: a wrong key, value, family or
file raises :class:`SpecError` naming it.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.decode import MODES, REFRESH_NEXT, DecodeConfig, Sampling
from kvlab.sweep.families import SECTIONS, parameters, required
from kvlab.sweep.students import StudentChoice, parse_students
from kvlab.sweep.values import SpecError, _check_keys, _err, expand_values

REPEAT_STRIDE = 10_000      # seed of (prompt i, repeat r) = seed + i + REPEAT_STRIDE * r
DEFAULT_PROMPTS = 8

TOP_KEYS = ("name", "prompts", "run", "sampling", "models", *SECTIONS)
PROMPT_KEYS = ("file", "count")
RUN_KEYS = ("modes", "tokens", "student", "prune", "student_ratio", "repeats", "refresh_next", "baseline", "chat")
SAMPLING_KEYS = ("temperature", "top_p", "seed")
MODEL_KEYS = ("kind", "teacher", "student", "device", "dtype")
MODEL_KINDS = ("embedded", "tiny")


@dataclass(frozen=True)
class PolicyChoice:
    """One policy of a family with concrete parameters."""

    section: str                 # "refresh" | "evict"
    family: str                  # registry name, e.g. "periodic"
    params: tuple                # ((name, value), ...) as given in the spec
    policy: Any = field(compare=False, hash=False)

    @property
    def label(self) -> str:
        return "_".join([self.family] + [f"{k}{_fmt(v)}" for k, v in self.params])


def _fmt(v) -> str:
    return format(v, "g") if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class ModelSpec:
    kind: str = "embedded"
    teacher: str | None = None
    student: str | None = None
    device: str | None = None
    dtype: str | None = None

    def key(self, student: StudentChoice | None) -> dict:
        """What identifies the weights of a task's pair (device excluded: a row is a row anywhere)."""
        d = {"kind": self.kind, "teacher": self.teacher, "student": self.student, "dtype": self.dtype}
        if self.student is None and student is not None:
            d["student_variant"], d["prune"] = student.variant, student.shape
        return d


@dataclass(frozen=True)
class Config:
    """One point of the grid (everything but prompt and seed)."""

    mode: str
    tokens: int
    student: StudentChoice | None     # the embedded student (None: models.student names the model)
    temperature: float
    top_p: float
    refresh_next: str
    choices: tuple                # PolicyChoice per section, or None

    @property
    def policy(self) -> str:
        """A short name: the mode alone without policies, else the policies' labels."""
        parts = [c.label for c in self.choices if c is not None]
        if not parts:
            return self.mode
        name = "+".join(parts)
        if self.mode != "overfill":
            name = f"{self.mode}+{name}"
        if self.refresh_next != "rerun" and self.choice("refresh") is not None:
            name += f"_{self.refresh_next}"
        return name

    @property
    def student_ratio(self) -> float | None:
        """The embedded student's MLP ratio (the old axis)."""
        return None if self.student is None else self.student.ratio

    def choice(self, section: str):
        for c in self.choices:
            if c is not None and c.section == section:
                return c
        return None

    def decode(self, seed: int, chat: bool = True) -> DecodeConfig:
        kw = {SECTIONS[c.section].field: c.policy for c in self.choices if c is not None}
        return DecodeConfig(mode=self.mode, max_new_tokens=self.tokens, chat=chat,
                            sampling=Sampling(temperature=self.temperature, top_p=self.top_p, seed=seed),
                            refresh_next=self.refresh_next, **kw)

    def columns(self) -> dict:
        """Flattened config columns of a results row."""
        out = {"policy": self.policy, "mode": self.mode, "max_new_tokens": self.tokens,
               **(self.student.columns() if self.student is not None else {"student_ratio": None}),
               "temperature": self.temperature, "top_p": self.top_p,
               "refresh_next": self.refresh_next if self.choice("refresh") is not None else ""}
        from kvlab.refresh.base import policy_dict

        for name in SECTIONS:
            c = self.choice(name)
            out[name] = c.family if c is not None else "none"
            if c is not None:
                for k, v in (policy_dict(c.policy) or {}).items():
                    if k != "policy":
                        out[f"{name}_{k}"] = v
        return out


@dataclass(frozen=True)
class Task:
    """One (config, prompt, repeat): what a worker runs. Picklable. ``task_id`` names the grid point
    (stable across parses); ``run_key`` is the run store's key of the run it makes, set by the
    driver once the workers told it the models' fingerprints (``""`` before)."""

    task_id: str
    sweep: str
    config: Config
    decode: DecodeConfig
    models: ModelSpec
    prompt: str
    prompt_idx: int
    repeat: int
    base_seed: int
    run_key: str = ""

    def columns(self) -> dict:
        """Config columns of this task's row (what an error row records; a finished run's row is
        built from its stored config instead)."""
        return {**self.config.columns(), "seed": self.decode.sampling.seed, "prompt": self.prompt,
                "prompt_id": hashlib.sha256(self.prompt.encode()).hexdigest()[:12]}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class GridSpec:
    name: str
    prompts: tuple[str, ...]
    prompt_file: str
    modes: tuple[str, ...]
    tokens: tuple[int, ...]
    students: tuple                       # StudentChoice per point of the student axis, or (None,)
    temperatures: tuple[float, ...]
    top_ps: tuple[float, ...]
    seed: int
    repeats: int
    refresh_next: tuple[str, ...]
    baseline: bool
    chat: bool
    models: ModelSpec
    choices: dict = field(hash=False)     # section -> [PolicyChoice]

    def configs(self) -> list[Config]:
        out = []
        for mode, n, student, temp, top_p in itertools.product(self.modes, self.tokens, self.students,
                                                                self.temperatures, self.top_ps):
            per_section = []
            for name, sec in SECTIONS.items():
                applies = sec.modes is None or mode in sec.modes
                opts = list(self.choices.get(name, [])) if applies else []
                if self.baseline or not opts:
                    opts = [None] + opts
                per_section.append(opts)
            for combo in itertools.product(*per_section):
                nexts = self.refresh_next if any(c is not None and c.section == "refresh" for c in combo) else ("rerun",)
                for nxt in nexts:
                    out.append(Config(mode, n, student, temp, top_p, nxt, tuple(combo)))
        return out

    def tasks(self) -> list[Task]:
        from kvlab.store.provenance import CODE_VERSION

        tasks = []
        for cfg in self.configs():
            for r in range(self.repeats):
                for i, prompt in enumerate(self.prompts):
                    try:
                        dec = cfg.decode(self.seed + i + REPEAT_STRIDE * r, chat=self.chat)
                    except ValueError as e:     # a combination the decode loop refuses (e.g. evict + refresh)
                        raise SpecError(f"grid config {cfg.policy!r} (mode {cfg.mode!r}) is invalid: {e}") from None
                    models = self.models.key(cfg.student)
                    task_id = _digest({"models": models, "prompt": prompt, "decode": dec.to_dict(), "code": CODE_VERSION})
                    tasks.append(Task(task_id, self.name, cfg, dec, self.models, prompt, i, r, self.seed))
        if not tasks:
            raise SpecError("the grid is empty: no (config, prompt) to run; check run.modes and the policy tables")
        seen = {}
        for t in tasks:           # two grid points that mean the same run (e.g. duplicate values)
            seen.setdefault(t.task_id, t)
        return list(seen.values())


# --------------------------------------------------------------------------- parsing


def _one(value, key: str, kind, check=None):
    if isinstance(value, bool) and kind is not bool:
        raise _err(key, f"must be {kind.__name__}, got {value!r}")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise _err(key, f"must be {kind.__name__}, got {value!r}")
    if check is not None:
        msg = check(value)
        if msg:
            raise _err(key, msg)
    return value


def _many(table, k, where, kind, default, check=None) -> tuple:
    key = f"{where}.{k}"
    vals = expand_values(table[k], key) if k in table else [default]
    return tuple(_one(v, key, kind, check) for v in vals)


def _policies(section: str, table) -> list[PolicyChoice]:
    sec = SECTIONS[section]
    registry = sec.registry()
    if not isinstance(table, dict):
        raise _err(section, "must hold one table per policy family, e.g. [refresh.periodic]")
    if not registry and table:
        raise _err(section, f"no {section} policies are available in this kvlab (registry is empty)")
    out = []
    for family, params in table.items():
        key = f"{section}.{family}"
        if family not in registry:
            raise _err(key, f"unknown {section} policy family; known: {', '.join(sorted(registry))}")
        cls = registry[family]
        if not isinstance(params, dict):
            raise _err(key, "must be a table of parameter = value(s)")
        allowed = parameters(cls)
        for p in params:
            if p not in allowed:
                raise _err(f"{key}.{p}", f"unknown parameter of {cls.__name__}; it takes: {', '.join(allowed)}")
        missing = [p for p in required(cls) if p not in params]
        if missing:
            raise _err(key, f"{cls.__name__} needs {', '.join(missing)}")
        names = list(params)
        lists = [expand_values(params[p], f"{key}.{p}") for p in names]
        for combo in itertools.product(*lists):
            kw = dict(zip(names, combo))
            try:
                policy = cls(**kw)
            except (ValueError, TypeError) as e:
                raise _err(key, f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kw.items())}) is invalid: {e}") from None
            out.append(PolicyChoice(section, family, tuple(kw.items()), policy))
    return out


def parse_spec(data: dict, base_dir: Path | None = None, name: str = "sweep") -> GridSpec:
    """A :class:`GridSpec` from a TOML-shaped dict (validated; prompts read)."""
    from kvlab.core.data import load_prompts, prompts_file

    _check_keys(data, TOP_KEYS, "")
    prompts_t, run_t = data.get("prompts", {}), data.get("run", {})
    samp_t, models_t = data.get("sampling", {}), data.get("models", {})
    _check_keys(prompts_t, PROMPT_KEYS, "prompts")
    _check_keys(run_t, RUN_KEYS, "run")
    _check_keys(samp_t, SAMPLING_KEYS, "sampling")
    _check_keys(models_t, MODEL_KEYS, "models")
    name = _one(data.get("name", name), "name", str, lambda v: None if v.strip() else "must be non-empty")

    modes = _many(run_t, "modes", "run", str, "overfill",
                  lambda v: None if v in MODES else f"mode {v!r} is not one of {MODES}")
    tokens = _many(run_t, "tokens", "run", int, 128, lambda v: None if v > 0 else "must be a positive int (N)")
    nexts = _many(run_t, "refresh_next", "run", str, "rerun",
                  lambda v: None if v in REFRESH_NEXT else f"must be one of {REFRESH_NEXT}")
    repeats = _one(run_t.get("repeats", 1), "run.repeats", int, lambda v: None if v > 0 else "must be a positive int")
    baseline = _one(run_t.get("baseline", True), "run.baseline", bool)
    chat = _one(run_t.get("chat", True), "run.chat", bool)
    temps = _many(samp_t, "temperature", "sampling", float, 0.7,
                  lambda v: None if v >= 0 and math.isfinite(v) else "must be >= 0 (0 = greedy)")
    top_ps = _many(samp_t, "top_p", "sampling", float, 0.9, lambda v: None if 0 < v <= 1 else "must be in (0, 1]")
    seed = _one(samp_t.get("seed", 0), "sampling.seed", int)

    kind = _one(models_t.get("kind", "embedded"), "models.kind", str,
                lambda v: None if v in MODEL_KINDS else f"must be one of {MODEL_KINDS}")
    models = ModelSpec(kind=kind, **{k: _one(models_t[k], f"models.{k}", str) for k in MODEL_KEYS[1:] if k in models_t})
    if kind == "tiny" and (models.teacher or models.student):
        raise _err("models.kind", "'tiny' builds its own models; drop models.teacher / models.student")
    students = parse_students(run_t, kind, models.student)
    if models.device is not None:
        from kvlab.core.models import resolve_device

        try:
            resolve_device(models.device)
        except ValueError as e:
            raise _err("models.device", str(e)) from None

    pf = prompts_t.get("file")
    if pf is None:
        path = prompts_file()
    else:
        pf = _one(pf, "prompts.file", str)
        path = Path(pf).expanduser()
        if not path.is_absolute() and base_dir is not None and (base_dir / path).is_file():
            path = base_dir / path
    count = _one(prompts_t.get("count", DEFAULT_PROMPTS), "prompts.count", int,
                 lambda v: None if v > 0 else "must be a positive int")
    try:
        rows = load_prompts(path, n=count)
    except (ValueError, FileNotFoundError) as e:
        raise _err("prompts.file" if "count" not in str(e) and "n=" not in str(e) else "prompts.count", str(e)) from None

    choices = {}
    for section in SECTIONS:
        if section in data:
            choices[section] = _policies(section, data[section])
            applies = SECTIONS[section].modes
            if choices[section] and applies is not None and not set(applies) & set(modes):
                raise _err(section, f"{section} policies need one of the modes {applies} in run.modes (got {list(modes)})")
    spec = GridSpec(name=name, prompts=tuple(r["prompt"] for r in rows), prompt_file=str(path), modes=modes,
                    tokens=tokens, students=students, temperatures=temps, top_ps=top_ps, seed=seed,
                    repeats=repeats, refresh_next=nexts, baseline=baseline, chat=chat, models=models, choices=choices)
    spec.tasks()          # every combination must build a valid DecodeConfig; an empty grid fails here
    return spec


def load_spec(path, overrides: dict | None = None) -> GridSpec:
    """Read and validate a TOML grid spec; ``overrides`` (a TOML-shaped dict) replaces keys table by table."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"grid spec {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"grid spec {str(path)!r} is not valid TOML: {e}") from None
    return parse_spec(merge(data, overrides or {}), base_dir=path.parent, name=path.stem)


def merge(data: dict, overrides: dict) -> dict:
    out = dict(data)
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_policy_flag(text: str, section: str) -> dict:
    """``"periodic T=16,32 W=8"`` or ``"entropy tau_bits=4..8:1"`` -> ``{"periodic": {"T": [16, 32], "W": 8}}``.

    Values: comma lists; ``a..b`` (step 1) or ``a..b:step`` ranges, stop inclusive."""
    parts = text.split()
    if not parts:
        raise _err(section, "empty policy flag; use e.g. --refresh 'periodic T=16,32'")
    family, params = parts[0], {}
    for p in parts[1:]:
        if "=" not in p:
            raise _err(f"{section}.{family}", f"{p!r} is not name=value(s)")
        k, v = p.split("=", 1)
        if ".." in v:
            a, rest = v.split("..", 1)
            b, _, s = rest.partition(":")
            params[k] = {"start": _scalar(a), "stop": _scalar(b), "step": _scalar(s) if s else 1}
        else:
            vals = [_scalar(x) for x in v.split(",") if x != ""]
            params[k] = vals if len(vals) != 1 else vals[0]
    return {family: params}


def _scalar(s: str):
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(s.lower(), s)

