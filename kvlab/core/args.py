"""Argument types for the command line (torch-free, imports nothing from kvlab)."""
from __future__ import annotations

import argparse


def positive_int(name: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {s!r}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer (> 0), got {v}")
        return v
    return parse
