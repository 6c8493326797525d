"""Benchmarks that print ratios measured in one run (they never assert: machines are noisy).
Timings go to stdout and, with ``--out``, to untracked timing files; nothing enters the run store.

One module per benchmark under :mod:`kvlab.studies.bench`; this module gathers their names (``from
kvlab.studies.bench.bench import bench_evict_batch`` keeps working)."""
from __future__ import annotations

from kvlab.studies.bench.decode import bench_decode, bench_decode_batch
from kvlab.studies.bench.evict import (_check_evict_bench, _evict_bench_cache, bench_evict, decode_evict_policies,
                                       default_evict_policies)
from kvlab.studies.bench.evict_batch import batch_evict_policies, bench_evict_batch, byte_bound
from kvlab.studies.bench.int8 import int8_effect
from kvlab.studies.bench.mc import bench_mc
from kvlab.studies.bench.refresh import bench_refresh
from kvlab.studies.bench.surgery import bench_surgery
from kvlab.studies.bench.timing import _sync, _timed, check_batches, peak_rss_mb

__all__ = ["bench_decode", "bench_decode_batch", "bench_evict", "bench_evict_batch", "bench_mc", "bench_refresh",
           "bench_surgery", "int8_effect", "default_evict_policies", "decode_evict_policies", "batch_evict_policies", "byte_bound",
           "check_batches", "peak_rss_mb", "_check_evict_bench", "_evict_bench_cache", "_sync", "_timed"]
