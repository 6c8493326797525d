"""``python -m kvlab kvpress``: kvpress's presses beside kvlab's sliding window (figures/evict_kvpress) and, with
``--heads``, head-mean vs per-head kept sets (figures/evict_kvpress_heads). Torch-free at import; the router adds
it with ``register(sub)``, as every study's cli module."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    """Add the ``kvpress`` subcommand to ``sub`` (the router's subparsers)."""
    from kvlab.studies.kvpress.job import add_kvpress_arguments

    p = sub.add_parser("kvpress", help="kvpress's presses at prefill and decode time beside kvlab's sliding window "
                                       "(evict_kvpress; --heads: head-mean vs per head)")
    add_kvpress_arguments(p)
    p.set_defaults(fn=cmd_kvpress)


def cmd_kvpress(args) -> list[Path]:
    import shlex
    import sys

    from kvlab.studies.kvpress import job

    return job.cmd_kvpress(args, "python -m kvlab " + " ".join(map(shlex.quote, sys.argv[1:])))
