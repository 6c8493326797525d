"""The notes printed under each table of the eviction job (``write_evict``)."""
from __future__ import annotations

TABLE_NOTES = {
    "evict_matched": [
        "Runs: the teacher alone (mode='teacher'), same prompts and per-prompt seeds for every policy.",
        "`kl`: mean over steps of KL(p_full ‖ p_evicted) in nats — the full-cache teacher's distribution (one "
        "uncached forward over prompt + continuation) vs the distribution the evicted cache gave, on the run's "
        "own tokens: the KL of the pruned cache to the full one (0 for `full`).",
        "Memory: `mean_mb` / `peak_mb` = mean / max over steps of the decoding cache's real K/V bytes after the "
        "evict phase (INT8 entries counted as 1 byte + scales); `target_mb` = Conf-KV's achieved mean; "
        "`mem_vs_target` = mean_mb / target_mb. Fixed-budget families were solved to the target (`knob`: the "
        "budget found; `probes`: every budget the solver ran, as knob:achieved MiB); Conf-KV ablations keep its schedule.",
        "`mean_mb_16bit`: the same mean entry count stored at 16 bits (the paper's FP16 cache; this CPU stores "
        "FP32), `mem_vs_16bit` = mean_mb / mean_mb_16bit (2.0 for an FP32 row; below 1 only where INT8 beats a 16-bit "
        "cache). `meta_mb`: mean bytes of the attention statistics a policy keeps (acc, ema, count per entry; 0 for "
        "policies that need none). `peak_fwd_mb`: the most K/V bytes held during one forward — INT8 entries are "
        "dequantized for every forward, so an INT8 cache's forward peak is its FP size plus the INT8 store.",
        "`frac_loose`: fraction of decode steps on which Conf-KV's schedule chose the loose budget; "
        "`frac_at_loose`: fraction on which the cache also stood at it (the loose budget binding); `min_len` .. "
        "`peak_len`: the cache's range over all steps and prompts (layer 0). `sinks`: the attention sinks the row's "
        "policy never evicts. `confkv_fixed`: Conf-KV's ranker at one fixed budget solved to Conf-KV's mean memory "
        "(the confidence-off control: schedule vs ranker). `mean_mb16`: mean bytes at the 16-bit reference (FP "
        "entries at 2 bytes/element, INT8 entries at 1 byte + 16-bit scales; the paper's accounting), "
        "`mem16_vs_target` against Conf-KV's.",
        "`kl_forced`: teacher-forced quality — mean KL(p_full ‖ p_evicted) along the FULL cache's own continuation "
        "of each prompt (tokens fixed, `DecodeConfig.forced`; the policy, its confidence and budget still act at "
        "every step), beside the free-running `kl` on each policy's own samples; `d_kl_forced_vs_confkv*`: paired "
        "differences to Conf-KV with bootstrap intervals.",
        "`d_*_vs_full`, `d_*_vs_confkv`: paired differences on the same prompts, mean and bootstrap 95 % interval "
        "(`_lo`, `_hi`, printable `_ci`); with fewer than 5 paired prompts no interval is given (\"n too small\"). "
        "`*_std`: per-prompt std. `tps`: decode tokens/s (machine-dependent).",
    ],
    "evict_sawtooth": ["Per-step cache of prompt 0 under each policy (after the evict phase); `confidence`, "
                       "`budget` from Conf-KV's signals; `refreshed` = a refresh fired after that step."],
    "evict_needle": ["Passkey retrieval (kvlab.eviction.needle): raw completion, greedy, 8 answer tokens; `accuracy` = "
                     "exact 5-digit match of the first number. `setting`: `streamed` = haystack prefilled, the question "
                     "teacher-forced through the decode loop (the policy, its confidence and budget act on every "
                     "question token), `prefill` = question prefilled with the haystack, eviction from the first answer "
                     "token on. Memory matched on the MEAN cache length over the decode steps per setting (Conf-KV "
                     "first, each fixed family solved to its mean: `mean_cache_len`). `depth` = fraction of filler "
                     "before the needle (0 = oldest, 1 = next to the question); `from_query` = prompt tokens between "
                     "the needle and the question."],
    "evict_gamma": ["The γ sweep: Conf-KV (same tight/loose/protect/sinks) at each γ, KL to the full cache against "
                    "mean memory; `confkv_fixed` (Conf-KV's ranker at one budget solved to the study's Conf-KV memory) "
                    "and `h2o` as reference points (γ NaN). Same prompts and seeds as evict_matched."],
    "evict_int8": ["Round-trip error of INT8 cache storage on the embedded teacher's real prefill K/V (first two study "
                   "prompts, every layer; the entries older than the protected window quantized as a cache prefix "
                   "would be). `mean_rel` = mean |x - x̂| / mean |x| (the paper reports 0.38 % for per-(head, channel) "
                   "INT8), `rel_fro` = ‖x - x̂‖/‖x‖, `max_abs` = largest element error; `bytes16_per_entry`: bytes of "
                   "one quantized entry of one tensor and layer with 16-bit scales (an FP16 entry is 2·H·D)."],
}
