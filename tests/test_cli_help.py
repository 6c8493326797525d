"""`python -m kvlab --help` is fast (no torch / transformers import) and states the defaults; the package's
public names still resolve (lazily)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HEAVY = ("torch", "transformers", "pandas", "matplotlib", "numpy")


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_help_imports_nothing_heavy_and_states_defaults():
    out = _run(
        "import sys, contextlib, io\n"
        "from kvlab.cli import main\n"
        "for argv in (['--help'], ['baselines', '--help'], ['evict', '--help'], ['bench', '--help']):\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    print(buf.getvalue())\n"
        f"print('HEAVY:', sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    assert "HEAVY: []" in out, out[-300:]
    flat = " ".join(out.split())          # argparse wraps lines
    assert "new tokens per run (N) (default: 128)" in flat
    assert "(default: 0.7)" in flat and "(default: 0)" in flat            # --temperature, --seed (0 is shown)
    assert "--gamma GAMMA evict: Conf-KV confidence threshold γ in [0, 1] (default: 0.9)" in flat
    assert "default: a CUDA GPU when present, else the CPU" in flat        # --device (None) says what None means
    assert "(default: None)" not in flat and "(default: False)" not in flat


def test_public_names_resolve_lazily():
    out = _run("import sys, kvlab\n"
               "print('torch' in sys.modules)\n"
               "from kvlab import Decoding, KVCache, load_pair\n"
               "import kvlab.decode, kvlab.cache\n"
               "print(Decoding is kvlab.decode.Decoding, KVCache is kvlab.cache.KVCache, 'torch' in sys.modules)\n"
               "print(set(kvlab.__all__) <= set(dir(kvlab)))\n"
               "try:\n    kvlab.nope\nexcept AttributeError as e:\n    print('AttributeError', e)\n")
    assert out.split("\n")[:4] == ["False", "True True True", "True", "AttributeError module 'kvlab' has no attribute 'nope'"]
