"""The trained default students shipped as fp16 LoRA adapters (kvlab/train/shipped): pinned content, used only
under a matching key (a mismatch is an error naming train-student), rebuilt exactly, reproducible by retraining."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvlab.train.config import BASE_TRAIN, DEFAULT_SHAPE, DEFAULT_TRAIN, PARETO_TRAIN, TRAINED_VARIANTS
from kvlab.train.shipped import (SHIPPED_DIR, ShippedAdapterMismatch, manifest, read_adapter, recipe, sha256,
                                 shipped_entry)

# The adapters committed in kvlab/train/shipped/ (trained by `python -m kvlab train-student --ship`), for two
# recipes at the default shape: the training Pareto's pick (160 steps, half the examples multi-turn histories),
# the default, so every committed student table comes from it (update those only with a retrain and `make
# figures`), and the base (80 steps, short prompts only: the default before the Pareto; --train-recipe base).
RECIPES = {"base": BASE_TRAIN, "pareto": PARETO_TRAIN}
PINNED = {
    "smollm2-135m-instruct-overfill-h0.20-i0.50-tdd05051f6b.safetensors": "bcbecdaefeeaa59af7edc72d1d38891380cf11a4c508f996e5e4e7f18169bd7f",
    "smollm2-135m-instruct-standalone-h0.20-i0.50-t29c76e0686.safetensors": "41f0e3369e78bf7155b11c642c574fd0c01952cfd9eaf62ac2cef3b46038a979",
    "smollm2-135m-instruct-refresh-aware-h0.20-i0.50-tdef3e85c0a.safetensors": "5a50e7f6183f9bad2af7687ef06268a4a08b9cb38b510c81c8ed0bf66c1aa7a0",
    "smollm2-135m-instruct-overfill-h0.20-i0.50-ta2a958138c.safetensors": "ffa3655732f747dd3dc10ac5270c01bd6f022e9d99c6329d5c8928f7b8202692",
    "smollm2-135m-instruct-standalone-h0.20-i0.50-tb693a7011f.safetensors": "5dc5ea7eee464096a613340c0c589fee10b12bed6773c4615a568b60a54fd66c",
    "smollm2-135m-instruct-refresh-aware-h0.20-i0.50-t34b155997c.safetensors": "ccb947359e70d76deb317154f903c881d1b916e74301ab3ea15e2c8bbb38fd61",
}


def _entry(tmp_path, variant="overfill", cfg=DEFAULT_TRAIN, **over):
    from kvlab.train.names import train_data_key, trained_name
    from kvlab.train.config import TRAIN_VERSION

    e = {"variant": variant, "shape": "h0.20-i0.50", "name": trained_name(variant, DEFAULT_SHAPE, cfg),
         "file": f"{variant}.safetensors", "log": f"{variant}.log.jsonl", "sha256": "0" * 64, "base": "b",
         "data_key": train_data_key(cfg), "train_version": TRAIN_VERSION, "recipe": recipe(cfg), **over}
    (tmp_path / "manifest.json").write_text(json.dumps({"adapters": [e]}))
    return e


def test_a_shipped_adapter_is_used_only_under_its_key(tmp_path, monkeypatch):
    e = _entry(tmp_path)
    assert shipped_entry("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN, root=tmp_path) == e
    # another variant, shape or recipe: nothing shipped (that student is trained as usual)
    assert shipped_entry("standalone", DEFAULT_SHAPE, DEFAULT_TRAIN, root=tmp_path) is None
    assert shipped_entry("overfill", "h0.45,i0.45", DEFAULT_TRAIN, root=tmp_path) is None
    assert shipped_entry("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN.replace(steps=240), root=tmp_path) is None
    # same variant/shape/recipe, but the training code changed since it was trained: an error naming train-student
    import kvlab.train.config as config

    monkeypatch.setattr(config, "TRAIN_VERSION", config.TRAIN_VERSION + "x")
    with pytest.raises(ShippedAdapterMismatch, match=r"training code version.*train-student --student overfill"):
        shipped_entry("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN, root=tmp_path)


def test_a_shipped_adapter_trained_on_other_data_is_refused(tmp_path):
    _entry(tmp_path, name="smollm2-135m-instruct-overfill-h0.20-i0.50-t0123456789", data_key="feedfacecafe")
    with pytest.raises(ShippedAdapterMismatch, match=r"training-data hash feedfacecafe.*python -m kvlab train-student"):
        shipped_entry("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN, root=tmp_path)


def test_shipping_keeps_one_file_pair_per_key(tmp_path, monkeypatch):
    """Files are named by the student's key: shipping a second recipe of one variant and shape adds an entry
    beside the first (both files keep their hashes); re-shipping a recipe under a new key (other training data)
    replaces its entry and removes the old files."""
    import kvlab.core.models as models
    import kvlab.train.names as names
    from kvlab.train.names import trained_dir
    from kvlab.train.shipped import ship

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "pruned_student_path", lambda shape: Path("pruned-base"))
    root = tmp_path / "shipped"
    root.mkdir()

    def train(cfg, byte):
        src = trained_dir("overfill", DEFAULT_SHAPE, cfg)
        src.mkdir(parents=True, exist_ok=True)
        (src / "adapter.safetensors").write_bytes(bytes([byte]) * 64)
        (src / "train_log.jsonl").write_text(json.dumps({"step": cfg.steps, "heldout_kl": byte / 10}) + "\n")
        (src / "train_meta.json").write_text("{}")
        return ship("overfill", DEFAULT_SHAPE, cfg, root=root)

    other = DEFAULT_TRAIN.replace(steps=DEFAULT_TRAIN.steps * 2, history=0.5)
    a, b = train(DEFAULT_TRAIN, 1), train(other, 2)
    assert a["file"] != b["file"] and a["file"] == a["name"] + ".safetensors"
    assert manifest(root) == sorted([a, b], key=lambda e: e["name"])
    for e, byte in ((a, 1), (b, 2)):
        assert sha256(root / e["file"]) == e["sha256"] and (root / e["file"]).read_bytes() == bytes([byte]) * 64
    assert shipped_entry("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN, root=root) == a
    assert shipped_entry("overfill", DEFAULT_SHAPE, other, root=root) == b
    # the same recipe under another training-data key: the stale entry and its files go, the other recipe stays
    monkeypatch.setattr(names, "train_data_key", lambda cfg: "feedfacecafe")
    c = train(other, 3)
    assert c["name"] != b["name"] and not (root / b["file"]).exists() and not (root / b["log"]).exists()
    assert {e["name"] for e in manifest(root)} == {a["name"], c["name"]} and (root / a["file"]).is_file()


def test_a_tampered_adapter_file_is_refused(tmp_path):
    from kvlab.train.shipped import build_from_shipped, write_adapter

    e = _entry(tmp_path)
    write_adapter(tmp_path / e["file"], {"m.lora_A": torch.zeros(2, 3, dtype=torch.float16),
                                         "m.lora_B": torch.zeros(3, 2, dtype=torch.float16)}, 2.0)
    with pytest.raises(ValueError, match="content hash"):
        build_from_shipped(e, tmp_path / "target", root=tmp_path)


def test_the_shipped_adapters_are_pinned_and_match_this_code():
    """The committed files hash to the pinned values, are fp16 and a few MB, and their keys match what this
    code trains: every trained variant with each shipped recipe, the default's among them (so `make figures`
    builds them instead of training)."""
    assert DEFAULT_TRAIN in RECIPES.values()
    entries = manifest()
    assert {e["file"]: e["sha256"] for e in entries} == PINNED
    by = {name: [e for e in entries if e["recipe"] == recipe(cfg)] for name, cfg in RECIPES.items()}
    assert sum(map(len, by.values())) == len(entries)                     # no entry of another recipe
    for name, es in by.items():
        assert sorted(e["variant"] for e in es) == sorted(TRAINED_VARIANTS)
        for e in es:
            f = SHIPPED_DIR / e["file"]
            assert f.name == e["name"] + ".safetensors" and sha256(f) == e["sha256"] == PINNED[e["file"]]
            assert f.stat().st_size < 8e6 and (SHIPPED_DIR / e["log"]).is_file()
            tensors, scale, _ = read_adapter(f)
            assert scale == 2.0 and all(t.dtype == torch.float16 for t in tensors.values())
            assert shipped_entry(e["variant"], DEFAULT_SHAPE, RECIPES[name]) == e      # the key matches: no raise


def test_make_figures_on_a_fresh_cache_trains_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    from kvlab.train.plan import plan

    shipped = {e["variant"] for e in manifest() if e["recipe"] == recipe(DEFAULT_TRAIN)}
    p = plan(TRAINED_VARIANTS, DEFAULT_SHAPE, DEFAULT_TRAIN)
    assert set(p.shipped) == shipped and set(p.train) == set(TRAINED_VARIANTS) - shipped
    q = plan(sorted(shipped), DEFAULT_SHAPE, DEFAULT_TRAIN)
    assert q.train == () and "shipped" in q.message() and "min" not in q.message()


@pytest.mark.integration
def test_a_student_built_from_its_adapter_is_the_pruned_base_plus_the_merge(tmp_path, monkeypatch):
    """Building from the shipped adapter gives pruned base + fp16 adapter merged in float64, and it loads
    like any trained student (here: the overfill one)."""
    from kvlab.core.models import load_model, pruned_student_path
    from kvlab.train.lora import merge_adapter
    from kvlab.train.names import trained_dir
    from kvlab.train.weights import trained_student_path

    real = __import__("kvlab.core.models", fromlist=["cache_dir"]).cache_dir()
    (tmp_path / "models").mkdir()
    for d in (real / "models").glob("*-pruned-*"):          # reuse the pruned bases (built in CI otherwise)
        (tmp_path / "models" / d.name).symlink_to(d)
    teacher = real / "models" / "smollm2-135m-instruct"
    if teacher.is_dir():
        (tmp_path / "models" / teacher.name).symlink_to(teacher)
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    path = trained_student_path("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN)      # no train_if_missing needed
    assert path == trained_dir("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN)
    meta = json.loads((path / "train_meta.json").read_text())
    assert meta["source"].startswith("shipped adapter") and (path / "train_log.jsonl").read_text()
    got = load_model(path, device="cpu", local_files_only=True)
    want = load_model(pruned_student_path(DEFAULT_SHAPE), device="cpu", local_files_only=True)
    e = shipped_entry("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN)
    merge_adapter(want.model, *read_adapter(SHIPPED_DIR / e["file"])[:2])
    sd = want.model.state_dict()
    assert all(torch.equal(v, sd[k]) for k, v in got.model.state_dict().items())


@pytest.mark.integration
@pytest.mark.long
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_short_retrain_follows_the_shipped_recipe(tmp_path, monkeypatch, name):
    """`train-student` with a shipped recipe, stopped after 2 steps in a fresh cache: its first steps' loss is
    the shipped log's (the same data, batches, init and loss; only float noise between machines). Uses the model
    cache's teacher data (and, for the default recipe, its multi-turn history examples); skips without them."""
    from kvlab.core.models import cache_dir
    from kvlab.train.names import train_data_key
    from kvlab.train.weights import train_student

    cfg = RECIPES[name]
    real = cache_dir()
    e = shipped_entry("overfill", DEFAULT_SHAPE, cfg)
    data = real / "train" / f"data-{e['data_key']}"
    if not (data / "examples.pt").is_file():
        pytest.skip("needs the default teacher data in the model cache (any trained default student builds it)")
    hist = []
    if cfg.history:             # the built history sets of this teacher, seed and token range (train + held-out)
        for h in (real / "train").glob("history-*"):
            try:
                m = json.loads((h / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            if ((h / "examples.pt").is_file() and m.get("seed") == cfg.seed
                    and tuple(m.get("history_tokens", ())) == tuple(cfg.history_tokens)):
                hist.append((m.get("tag"), h))
        if {t for t, _ in hist} != {"train", "heldout"}:
            pytest.skip("needs the multi-turn history examples in the model cache (a trained default student "
                        "builds them: `python -m kvlab train-student --student overfill`, ~40 min of it)")
    for sub in ("models", "train"):
        (tmp_path / sub).mkdir()
    for d in (real / "models").glob("smollm2-135m-instruct*"):
        if "-pruned-" in d.name or d.name == "smollm2-135m-instruct":
            (tmp_path / "models" / d.name).symlink_to(d)
    (tmp_path / "train" / data.name).symlink_to(data)
    for _, h in hist:
        (tmp_path / "train" / h.name).symlink_to(h)
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    assert train_data_key(cfg) == e["data_key"]
    run = train_student("overfill", DEFAULT_SHAPE, cfg, progress=False, stop_after=2)
    got = torch.load(run / "ckpt.pt", weights_only=False)["log"]
    want = [json.loads(x) for x in (SHIPPED_DIR / e["log"]).read_text().splitlines()][:2]
    assert [r["step"] for r in got] == [1, 2] and [r["tokens"] for r in got] == [r["tokens"] for r in want]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3) and a["lr"] == pytest.approx(b["lr"])
    shutil.rmtree(run, ignore_errors=True)


@pytest.mark.integration
def test_speed_beside_quality_per_shape_in_one_run(tmp_path, monkeypatch):
    """`bench students`: teacher and student timed in one run; an untrained shape says so. Runs in a fresh
    model cache holding only the teacher, so a student trained earlier in the user's cache (e.g. by
    `train-pareto`, which trains i0.30) cannot turn the row into a trained one."""
    from kvlab.core.models import cache_dir
    from kvlab.studies.training.speed import speed_quality

    real = cache_dir()
    (tmp_path / "models").mkdir()
    teacher = real / "models" / "smollm2-135m-instruct"
    if teacher.is_dir():
        (tmp_path / "models" / teacher.name).symlink_to(teacher)
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    df = speed_quality(["i0.30"], steps=4, repeats=1, device="cpu")
    row = df.iloc[0]
    assert row["shape"] == "i0.30" and row["student"] == "pruned (untrained)"
    assert row["params_M"] < row["teacher_params_M"]
    assert row["speedup"] == pytest.approx(row["teacher_ms_step"] / row["student_ms_step"], rel=0.01)
