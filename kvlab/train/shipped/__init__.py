"""The trained default students, shipped in the repository as fp16 LoRA adapters.

Why: trained weights differ between machines (float summation order on another CPU changes a training run),
so tables that quote students trained on one machine do not reproduce on another. The adapters trained once
(``python -m kvlab train-student --ship``) are committed here with ``manifest.json``; a fresh model cache
rebuilds each student as *pruned base + fp16 adapter, merged in float64* (:func:`kvlab.train.lora.merge_adapter`),
the same weights on every machine, in seconds and without training.

An adapter is used only when its key matches what this code would train: variant, prune shape (and the
pruned base's calibration digest), training-data hash, every weight-changing recipe setting and
``TRAIN_VERSION`` (the folder name ``…-<variant>-<shape>-t<key>``). A shipped adapter for the requested
variant, shape and recipe whose data hash or training-code version no longer matches is an error naming
``python -m kvlab train-student`` (retrain and re-ship), never a silent fallback.

Files, one pair per shipped student, named by its key (the model cache's folder name, so several recipes of one
variant and shape can be shipped side by side): ``<name>.safetensors`` (A/B per adapted Linear, fp16, metadata:
scale) and ``<name>.log.jsonl`` (its training log: the train study's curves).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent
MANIFEST = SHIPPED_DIR / "manifest.json"


class ShippedAdapterMismatch(ValueError):
    """A shipped adapter exists for this variant/shape/recipe but was trained under another key."""


def write_adapter(path, tensors: dict, scale: float, meta: dict | None = None) -> Path:
    """Write ``tensors`` (fp16 LoRA A/B per module) and ``scale`` as one safetensors file."""
    from safetensors.torch import save_file

    path = Path(path)
    info = {"scale": repr(float(scale)), "format": "kvlab-lora-1", **{k: str(v) for k, v in (meta or {}).items()}}
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path), metadata=info)
    return path


def read_adapter(path) -> tuple[dict, float, dict]:
    """``(tensors, scale, metadata)`` of an adapter file written by :func:`write_adapter`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != "kvlab-lora-1" or "scale" not in meta:
        raise ValueError(f"{path}: not a kvlab LoRA adapter file (no 'format: kvlab-lora-1' metadata)")
    return tensors, float(meta["scale"]), meta


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def recipe(cfg) -> dict:
    """The weight-changing settings of ``cfg`` (:meth:`TrainConfig.recipe`, JSON-normalised)."""
    return json.loads(json.dumps(cfg.recipe(), default=list))


def manifest(root: Path | None = None) -> list[dict]:
    p = Path(root or SHIPPED_DIR) / "manifest.json"
    return json.loads(p.read_text())["adapters"] if p.is_file() else []


def shipped_entry(variant: str, shape, cfg, root: Path | None = None) -> dict | None:
    """The manifest entry for ``variant`` at ``shape`` trained with ``cfg``'s recipe, or None if none is shipped.

    Raises :class:`ShippedAdapterMismatch` (naming ``train-student``) when one is shipped for that variant,
    shape and recipe but its key (training data, ``TRAIN_VERSION``) is not the one this code computes."""
    from kvlab.train.config import TRAIN_VERSION
    from kvlab.train.names import _shape, train_command, train_data_key, trained_name

    shape = _shape(shape)
    want = recipe(cfg)
    for e in manifest(root):
        if e["variant"] != variant or e["shape"] != shape.label or e["recipe"] != want:
            continue
        name = trained_name(variant, shape, cfg)
        if e["name"] != name:
            why = []
            if e.get("train_version") != TRAIN_VERSION:
                why.append(f"training code version {e.get('train_version')!r} → {TRAIN_VERSION!r}")
            if e.get("data_key") != train_data_key(cfg):
                why.append(f"training-data hash {e.get('data_key')} → {train_data_key(cfg)}")
            raise ShippedAdapterMismatch(
                f"the shipped {variant!r} adapter ({shape.flag}, kvlab/train/shipped/{e['file']}) was trained under key "
                f"{e['name']}, but this code trains {name} ({'; '.join(why) or 'the key changed'}): it no longer "
                f"matches. Retrain and re-ship it with `{train_command(variant, shape, cfg)} --ship` (then commit "
                "kvlab/train/shipped/), or pass --student pruned for the untrained student")
        return e
    return None


def build_from_shipped(entry: dict, target: Path, root: Path | None = None) -> Path:
    """The student folder ``target``: the pruned base with the shipped fp16 adapter merged (float64), its
    training log and meta beside it. Checks the file's content hash and the pruned base first."""
    import torch

    from kvlab.core.models import _atomic_save, cache_lock, load_model, pruned_student_path
    from kvlab.train.lora import merge_adapter
    from kvlab.train.trainer import write_log

    root = Path(root or SHIPPED_DIR)
    f = root / entry["file"]
    if not f.is_file() or sha256(f) != entry["sha256"]:
        raise ValueError(f"shipped adapter {f} is missing or its content hash is not the manifest's "
                         f"({entry['sha256'][:12]}…): restore it from git (`git checkout -- {f}`) or retrain with "
                         f"`python -m kvlab train-student --student {entry['variant']} --ship`")
    base = pruned_student_path(entry["shape"])
    if base.name != entry["base"]:
        raise ShippedAdapterMismatch(
            f"the shipped {entry['variant']!r} adapter was trained on the pruned base {entry['base']}, but this code "
            f"prunes {base.name} (calibration data changed): retrain and re-ship with "
            f"`python -m kvlab train-student --student {entry['variant']} --ship`")
    with cache_lock(target.name, f"building the {entry['variant']} student from its shipped adapter"):
        if (target / "config.json").is_file():
            return target
        lm = load_model(base, device="cpu", dtype=torch.float32, local_files_only=True)
        tensors, scale, _ = read_adapter(f)
        merge_adapter(lm.model, tensors, scale)
        log_file = root / entry["log"]
        log = [json.loads(x) for x in log_file.read_text().splitlines() if x.strip()] if log_file.is_file() else []
        meta = {**entry.get("meta", {}), "source": f"shipped adapter kvlab/train/shipped/{entry['file']}",
                "adapter_sha256": entry["sha256"]}

        def write(tmp: Path) -> None:
            lm.model.config.name_or_path = target.name
            lm.model.save_pretrained(tmp)
            lm.tokenizer.save_pretrained(tmp)
            write_log(log, tmp, meta)
            (tmp / "adapter.safetensors").write_bytes(f.read_bytes())

        _atomic_save(target, write)
    return target


def ship(variant: str, shape, cfg, root: Path | None = None) -> dict:
    """Copy the cached trained ``variant``'s fp16 adapter and log into the repository and record it in the
    manifest. An entry for the same variant, shape and recipe (a stale key: other training data or code version)
    is replaced and its files removed; entries of other recipes stay. Returns the entry."""
    from kvlab.core.models import pruned_student_path
    from kvlab.train.config import TRAIN_VERSION
    from kvlab.train.names import _shape, train_data_key, trained_dir

    shape = _shape(shape)
    root = Path(root or SHIPPED_DIR)
    src = trained_dir(variant, shape, cfg)
    if not (src / "adapter.safetensors").is_file():
        raise FileNotFoundError(f"{src} has no adapter.safetensors: only LoRA students (--lora-rank > 0) trained by "
                                "this version of `python -m kvlab train-student` can be shipped")
    stem = src.name                      # the key: one file pair per variant, shape and recipe
    (root / f"{stem}.safetensors").write_bytes((src / "adapter.safetensors").read_bytes())
    (root / f"{stem}.log.jsonl").write_bytes((src / "train_log.jsonl").read_bytes())
    meta = json.loads((src / "train_meta.json").read_text())
    log = [json.loads(x) for x in (src / "train_log.jsonl").read_text().splitlines() if x.strip()]
    held = [r for r in log if "heldout_kl" in r]
    entry = {"variant": variant, "shape": shape.label, "name": src.name, "file": f"{stem}.safetensors",
             "log": f"{stem}.log.jsonl", "sha256": sha256(root / f"{stem}.safetensors"),
             "base": pruned_student_path(shape).name, "data_key": train_data_key(cfg), "train_version": TRAIN_VERSION,
             "recipe": recipe(cfg), "heldout_kl": held[-1]["heldout_kl"] if held else None,
             "meta": {k: meta.get(k) for k in ("train_examples", "heldout_examples", "response_tokens",
                                               "train_s_last_session", "data_s", "device", "torch_threads",
                                               "machine", "finished_utc")}}
    keep, stale = [], []
    for e in manifest(root):
        same = e["name"] == entry["name"] or (e["variant"] == variant and e["shape"] == shape.label
                                              and e["recipe"] == entry["recipe"])
        (stale if same else keep).append(e)
    used = {entry["file"], entry["log"]} | {e[k] for e in keep for k in ("file", "log")}
    for e in stale:                      # a replaced entry's files go with it (unless still named by another)
        for k in ("file", "log"):
            if e[k] not in used:
                (root / e[k]).unlink(missing_ok=True)
    entries = keep
    entries.append(entry)
    entries.sort(key=lambda e: (e["shape"], e["variant"], e["name"]))
    (root / "manifest.json").write_text(json.dumps({"about": "trained students as fp16 LoRA adapters, one file pair per key; "
                                                    "see kvlab/train/shipped/__init__.py", "adapters": entries},
                                                   indent=1) + "\n")
    return entry
