"""README.md and docs/: every experiment number they quote is regenerated from figures/*.csv and must equal
what is written (regenerate-and-compare); the generator tolerates new columns and rows and names what is
missing; the README stays short, shows a figure, links only to files that exist, and its Python example runs."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvlab.viz import docs

ROOT = docs.ROOT
README = ROOT / "README.md"


def test_every_quoted_number_agrees_with_its_table():
    """Fails when a table in figures/ changed and `python -m kvlab docs` was not re-run (or a number was
    typed by hand inside a generated block)."""
    stale = docs.stale(ROOT)
    assert not stale, f"run `python -m kvlab docs`: generated numbers disagree with figures/ in {stale}"


def test_docs_quote_their_numbers_through_markers():
    """README and every docs page quote experiment results through generated blocks, and every block
    names a view or a table that exists."""
    pages = docs.doc_files(ROOT)
    assert README in pages and len(pages) >= 10
    text = README.read_text()
    assert "<!-- kvlab:table key_results -->" in text
    for p in pages:
        t = p.read_text()
        for m in docs.BLOCK.finditer(t):
            name = m.group("name")
            assert name in docs.VIEWS or (ROOT / "figures" / f"{name[3:]}.md").exists(), f"{p}: unknown view {name}"
        # an opening marker without its closing one would silently stop being regenerated
        assert t.count("<!-- kvlab:table ") == t.count("<!-- /kvlab:table -->"), p
        assert t.count("<!-- kvlab:value ") == t.count("<!-- /kvlab:value -->"), p


def test_no_result_is_typed_outside_the_generated_blocks():
    """Measured values look like 0.938, 1.03×, ± 0.3 or [−0.12, +0.31]; outside generated blocks and code the pages
    hold settings (T = 0.7, 95 %) and the papers' figures, never such a result."""
    result = re.compile(r"\d\.\d{3}|\d×|±\s*\d|\[[-+−]?\d+\.\d+,\s*[-+−]?\d+\.\d+\]")
    for p in docs.doc_files(ROOT):
        t = docs.VALUE.sub("", docs.BLOCK.sub("", p.read_text()))
        t = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", t, flags=re.S))
        hits = [t[max(0, m.start() - 30):m.end() + 10] for m in result.finditer(t)]
        assert not hits, f"{p.name}: a typed result outside a generated block: {hits}"


def test_each_study_quotes_its_tables_from_its_own_folder():
    """Every study's views and key-results rows live in ``kvlab/studies/<study>/quotes.py``; the generator only
    gathers them, in a fixed order, and a view name given by two modules is an error naming both."""
    import types

    for study in docs.STUDIES:
        assert study.__name__.startswith("kvlab.studies.") and study.__name__.endswith(".quotes"), study
        assert set(study.VIEWS) <= set(docs.VIEWS) and callable(study.key_results), study
    assert {"key_results", "phases"} <= set(docs.VIEWS)
    twice = types.SimpleNamespace(__name__="elsewhere", VIEWS={"baselines": None})
    with pytest.raises(ValueError, match="baselines.*kvlab.studies.baselines.quotes.*elsewhere"):
        docs._gather(docs.STUDIES + (twice,), {})


def test_a_wrong_number_is_rewritten_and_detected(tmp_path):
    md = ("Periodic T=14: <!-- kvlab:value refresh_periodic periodic_T14 d_kl,d_kl_lo,d_kl_hi -->"
          "-0.156 [-0.253, -0.042]<!-- /kvlab:value -->.\n\n"
          "<!-- kvlab:table refresh_forced -->\nold table\n<!-- /kvlab:table -->\n")
    row = pd.read_csv(ROOT / "figures" / "refresh_periodic.csv").set_index("policy").loc["periodic_T14"]
    out = docs.fill(md)
    want = docs.cell(row, ("d_kl", "d_kl_lo", "d_kl_hi"))
    assert f"-->{want}<!--" in out and "-0.156" not in out
    assert "old table" not in out and "| overfill |" in out
    assert docs.fill(out) == out                        # idempotent: a second run changes nothing
    # the project's check sees a stale page
    root = tmp_path / "proj"
    (root / "docs").mkdir(parents=True)
    shutil.copytree(ROOT / "figures", root / "figures", ignore=shutil.ignore_patterns("*.png"))
    (root / "README.md").write_text("# x\n")
    (root / "docs" / "page.md").write_text(md)
    assert docs.stale(root) == [root / "docs" / "page.md"]
    assert docs.write(root) == [root / "docs" / "page.md"] and docs.stale(root) == []


def test_new_columns_and_rows_need_no_change(tmp_path):
    """Other jobs add columns and rows to the tables: views select by name and render every row."""
    df = pd.read_csv(ROOT / "figures" / "refresh_periodic.csv")
    extra = df.iloc[[1]].assign(policy="periodic_T3", T=3)
    df = pd.concat([df, extra]).assign(new_metric=1.5)
    df.insert(3, "another", "x")
    df.to_csv(tmp_path / "refresh_periodic.csv", index=False)
    out = docs.render_view("refresh_periodic", tmp_path)
    assert "| periodic_T3 |" in out and "new_metric" not in out
    assert out.count("\n| ") == len(df)                # every row (the header opens the block)


def test_needle_table_with_settings(tmp_path):
    """The passkey table may gain a `setting` column: one row per (setting, policy), each from its own runs."""
    df = pd.read_csv(ROOT / "figures" / "evict_needle.csv")
    both = pd.concat([df.assign(setting="prefill"), df.assign(setting="streamed", accuracy=0.0)])
    both.to_csv(tmp_path / "evict_needle.csv", index=False)
    out = docs.render_view("evict_needle", tmp_path)
    assert out.splitlines()[0].startswith("| setting | policy |")
    assert "| prefill | full | 1.00 |" in out and "| streamed | full | 0.00 |" in out


def test_a_missing_column_or_row_is_named(tmp_path):
    df = pd.read_csv(ROOT / "figures" / "refresh_periodic.csv").drop(columns=["d_kl_hi"])
    df.to_csv(tmp_path / "refresh_periodic.csv", index=False)
    with pytest.raises(docs.DocsError, match="no column 'd_kl_hi'"):
        docs.render_view("refresh_periodic", tmp_path)
    with pytest.raises(docs.DocsError, match="matches 0 rows"):
        docs.render_value("refresh_periodic periodic_T99 kl", tmp_path)
    with pytest.raises(docs.DocsError, match="does not exist"):
        docs.render_value("nosuch row kl", tmp_path)
    with pytest.raises(docs.DocsError, match="no table view 'nosuch'"):
        docs.render_view("nosuch")


def test_cli_check_passes_and_docs_is_a_step_of_all():
    out = subprocess.run([sys.executable, "-m", "kvlab", "docs", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "agree with figures/" in out.stdout
    from kvlab import cli

    src = Path(cli.__file__).read_text()
    start = src.index("def cmd_all")
    body = src[start:src.index("\ndef ", start + 1)]
    assert "timed(\"docs\", cmd_docs)" in body          # `make figures` = `python -m kvlab all` regenerates them


def test_docs_skip_a_foreign_figures_folder(tmp_path, capsys):
    """`python -m kvlab all --out /tmp/x` (tiny or trial tables) must not rewrite the project's README."""
    from kvlab import cli

    args = cli.build_parser().parse_args(["docs", "--out", str(tmp_path)])
    assert docs.cmd_docs(args) == []
    assert "skipped" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ README
def test_readme_is_short_with_a_figure_the_commands_and_links_that_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for needle in ("make figures", "make test", "make lab"):
        assert needle in text
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images and all((ROOT / i).exists() for i in images)
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))  # code is no link
        for link, anchor in re.findall(r"\]\(([^)#]+)(?:#([^)]*))?\)", prose):
            if "://" in link:
                continue
            target = (page.parent / link).resolve()
            assert target.exists(), f"{page.name}: broken link {link}"
            if anchor and target.suffix == ".md" and target.exists():
                assert anchor in _anchors(target), f"{page.name}: {link} has no heading #{anchor}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "README.md holds exactly one Python example"
    return blocks[0]


def test_readme_example_is_short():
    assert 10 <= len(_readme_example().strip().splitlines()) <= 15


@pytest.mark.integration
def test_readme_example_runs(tmp_path):
    """Runs README's example as written, on the real pair. The README loads the trained default student, which
    `make figures` trains (minutes of CPU); where the model cache lacks it (CI starts empty) the example stops
    with the error naming `python -m kvlab train-student`, and the test then runs it again with the untrained
    pruned student the other real-pair tests use (`load_pair(variant="pruned", shape="i0.30")`, built from the
    teacher in seconds). Everything else — the refresh and eviction policies, the loop, the trace — runs exactly
    as printed."""
    code = _readme_example()
    assert code.count("kvlab.load_pair()") == 1
    script = tmp_path / "example.py"

    def run(src: str):
        script.write_text(src)
        return subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600)

    out = run(code)
    if out.returncode != 0 and "train-student" in out.stderr:
        out = run(code.replace("kvlab.load_pair()", 'kvlab.load_pair(device="cpu", variant="pruned", shape="i0.30")'))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any("refreshed" in ln and "cache_len" in ln for ln in lines)     # the trace frame's header
    assert "True" in out.stdout                                            # a refresh fired
    writers = lines[-1]
    assert set(writers) <= {"t", "s"} and "t" in writers                   # the live map's writers


def test_generated_links_resolve_from_the_page_they_are_in():
    """Views write links from the project root (figures/x.md, docs/measured/y.jsonl); a block in docs/*.md gets
    them rebased (../figures/x.md, measured/y.jsonl), so every relative link in a generated block of README.md or
    docs/*.md names a file that exists, seen from that page."""
    assert docs.rebase_links("[a](figures/x.md) [b](docs/measured/y.jsonl) [c](https://e.org/z) [d](#h)", "docs") == \
        "[a](../figures/x.md) [b](measured/y.jsonl) [c](https://e.org/z) [d](#h)"
    assert docs.rebase_links("[a](figures/x.md)", "") == "[a](figures/x.md)"
    seen = 0
    for p in docs.doc_files(ROOT):
        for m in docs.BLOCK.finditer(p.read_text()):
            for link in docs.LINK.finditer(m.group("body")):
                path = link.group("path").split("#")[0]
                if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path):
                    continue
                assert (p.parent / path).exists(), f"{p.name}: the generated link {path!r} names no file"
                seen += 1
    assert seen >= 5


def test_phases_total_is_the_wall_clock_when_jobs_ran_side_by_side(tmp_path, monkeypatch):
    """`all --jobs 2` writes a "wall" row (train + the overlapping jobs); the phase table lists the jobs, not the wall
    row, and its total is that wall clock plus the steps after it, not the sum of overlapping jobs."""
    import json

    env = {"started": "2026-11-27T00:00:00", "prompts": 32, "device": "cpu", "threads": 2, "cpu": "x", "workers": 2}
    rows = [("train", 60), ("refresh", 600), ("evict", 540), ("wall", 700), ("figures", 6), ("docs", 6)]
    path = tmp_path / "timing.jsonl"
    path.write_text("".join(json.dumps({**env, "job": j, "seconds": s}) + "\n" for j, s in rows))
    monkeypatch.setattr(docs, "MEASURED_PHASES", str(path))        # absolute: ROOT / it is it
    text = docs._phases(tmp_path)
    assert "| wall |" not in text and "| refresh | 10 |" in text and "| evict | 9.0 |" in text
    assert "| **all** | **11.9** |" in text and "2 jobs side by side" in text     # (700 + 6 + 6) / 60
    path.write_text("".join(json.dumps({**env, "workers": 1, "job": j, "seconds": s}) + "\n" for j, s in rows
                            if j != "wall"))
    assert "| **all** | **20.2** |" in docs._phases(tmp_path)                    # one after another: the sum
