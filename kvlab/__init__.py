"""kvlab — a research workbench for what happens to the KV cache while an LLM decodes."""
from .cache import KVCache, Ledger, Row
from .compat import IncompatiblePairError, kv_compat
from .decode import DecodeConfig, Decoding, Sampling, StepRecord, Trace, run
from .metrics import repeat_at_n, score
from .models import LM, load_model, load_pair, load_student, load_teacher

__all__ = [
    "KVCache", "Ledger", "Row", "IncompatiblePairError", "kv_compat", "DecodeConfig", "Decoding",
    "Sampling", "StepRecord", "Trace", "run", "repeat_at_n", "score", "LM", "load_model", "load_pair",
    "load_student", "load_teacher",
]
__version__ = "0.1.0"
