"""Every kvpress ScorerPress that needs no download, through kvlab's batched decode on the embedded teacher:
batch 8 (~200-token prompts, 3 tokens, budget 64, sinks 4), every row cut to the budget and rows 0, 3 and 7 (first,
middle, last: different prompt lengths) equal to their batch-1 runs (tokens and the kept positions of every layer
after every step; a press whose score is random by design — :data:`UNSEEDED` —
its budget and first token). Integration (the real teacher); skipped without kvpress."""
from __future__ import annotations

import pytest

kvpress = pytest.importorskip("kvpress")

import kvlab  # noqa: E402
from kvlab.decode import run_batch  # noqa: E402
from kvlab.eviction.kvpress import installed_presses  # noqa: E402
from kvlab.eviction.scorer import ScorerPolicy  # noqa: E402
from kvlab.studies.kvpress.presses import PRESSES, make_press  # noqa: E402

DOWNLOADS = {"QFilterPress", "KVzapPress", "ExpectedAttentionStatsPress"}   # post_init_from_model downloads
SCORERS = sorted(r["press"] for r in installed_presses() if r["runs"] == "scorer" and r["press"] not in DOWNLOADS)
# presses whose score draws from torch's global generator unseeded: no two runs keep the same entries (batched
# or not), so their rows are checked for the budget and the prefill's token only
UNSEEDED = {"LeverageScorePress": "its score draws a Gaussian sketch with torch.randn, unseeded"}
CHECKED = (0, 3, 7)      # rows compared with their batch-1 runs (each costs a prefill on the 2-core CPU)
BASE = ("Explain, step by step, how a key-value cache speeds up autoregressive decoding in a transformer, what it "
        "stores per layer and head, why its memory grows with the context, and which methods compress it. ") * 4


def test_the_study_knows_every_scorer():
    """A kvpress release that adds a ScorerPress fails here by name until the study gives it settings."""
    assert set(SCORERS) <= set(PRESSES), sorted(set(SCORERS) - set(PRESSES))


@pytest.mark.integration
@pytest.mark.parametrize("name", SCORERS)
def test_batch_8_rows_equal_their_single_runs(name, real_pair):
    teacher, _ = real_pair
    prompts = [BASE[7 * i:] for i in range(8)]
    cfg = kvlab.DecodeConfig(mode="teacher", max_new_tokens=3, evict=ScorerPolicy(make_press(name), budget=64,
                                                                                  sinks=4))
    kept_b: list[list] = [[] for _ in prompts]
    batch = run_batch(teacher, None, prompts, cfg,
                      on_step=lambda b, rec, d: kept_b[b].append([list(p) for p in d.cache.layer_positions()]))
    for b, (p, t) in enumerate(zip(prompts, batch)):
        assert all(len(q) == 64 for q in kept_b[b][0]), f"{name} row {b}: the prompt was not cut to the budget"
        if b not in CHECKED:
            continue
        kept_1: list = []
        one = kvlab.run(teacher, None, p, cfg,
                        on_step=lambda rec, d: kept_1.append([list(q) for q in d.cache.layer_positions()]))
        if name in UNSEEDED:
            assert t.tokens[0] == one.tokens[0], f"{name} row {b}: the prefill's token differs"
            continue
        assert t.tokens == one.tokens, f"{name} row {b}: tokens differ from its batch-1 run"
        assert kept_b[b] == kept_1, f"{name} row {b}: kept positions differ from its batch-1 run"
