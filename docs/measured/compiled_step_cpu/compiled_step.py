"""Eager vs torch.compile'd decode step of the embedded teacher (HF StaticCache, batch B) at two cache widths:
does a compiled step reach more of the byte bound on this CPU? (session 14 experiment)"""
import json, statistics, sys, time
import torch
from transformers import StaticCache

def main(B=8, lens=(1040, 4112), steps=20, tiny=False):
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256)).eval()
        name = "tiny"
    else:
        from kvlab.core.models import load_teacher
        lm = load_teacher(); model = lm.model; name = lm.name
    model.set_attn_implementation("sdpa")
    cfg = model.config
    caches = {}
    for L in lens:
        c = StaticCache(config=cfg, max_cache_len=L)
        # fill: one short prefill creates the layers; the rest of the width is random K/V (timing reads all of it)
        with torch.inference_mode():
            model(input_ids=torch.zeros(B, 8, dtype=torch.long), past_key_values=c, use_cache=True)
            for lay in c.layers:
                lay.keys.normal_(); lay.values.normal_()
        caches[L] = c
    def step(fn, L, pos):
        c = caches[L]
        ids = torch.ones(B, 1, dtype=torch.long)
        cp = torch.tensor([pos])
        with torch.inference_mode():
            return fn(input_ids=ids, past_key_values=c, cache_position=cp, position_ids=cp.expand(B, 1), use_cache=True)
    eager = model.forward
    t0 = time.perf_counter()
    comp = torch.compile(model.forward, dynamic=False)
    for L in lens:                      # compile (one graph per width) + warm-up
        for _ in range(3):
            step(comp, L, L - 2); step(eager, L, L - 2)
    compile_s = time.perf_counter() - t0
    times = {(k, L): [] for k in ("eager", "compiled") for L in lens}
    for i in range(steps):
        order = [("eager", eager), ("compiled", comp)]
        if i % 2: order.reverse()
        for L in lens:
            for k, fn in order:
                t = time.perf_counter(); step(fn, L, L - 2); times[(k, L)].append(time.perf_counter() - t)
    med = {f"{k}_{L}": round(1000 * statistics.median(v), 2) for (k, L), v in times.items()}
    w = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    hkv = cfg.num_key_value_heads; d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    e = cfg.num_hidden_layers * 2 * hkv * d * 4 * B
    bound = (w + e * lens[1]) / (w + e * lens[0])
    row = {"model": name, "batch": B, "lens": list(lens), "compile_s": round(compile_s, 1), **med, "bound": round(bound, 3),
           "eager_speedup": round(med[f"eager_{lens[1]}"] / med[f"eager_{lens[0]}"], 3),
           "compiled_speedup": round(med[f"compiled_{lens[1]}"] / med[f"compiled_{lens[0]}"], 3),
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    row["eager_frac"] = round(row["eager_speedup"] / bound, 3); row["compiled_frac"] = round(row["compiled_speedup"] / bound, 3)
    print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main(tiny="--tiny" in sys.argv, steps=5 if "--tiny" in sys.argv else 20)
