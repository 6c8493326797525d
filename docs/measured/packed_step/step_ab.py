"""A/B of one batched decode step of the embedded teacher (batch 8, random K/V of T columns, a bool mask): the model's
own forward (the "kvlab" attention) vs the layers written out with F.linear, MKL packed and oneDNN packed products;
medians of 20 alternating rounds. Run alone: python docs/measured/packed_step/step_ab.py 1030  (and 4112)."""
import time, sys, torch, torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer
from kvlab.core.models import load_teacher
from kvlab.cache import attn_fn
torch.manual_seed(0)
lm = load_teacher(); model = lm.model.eval()
cfg = model.config
B, T = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 1030
L, Hkv, D, H, C = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size
cap = T + 64
K = [torch.randn(B, Hkv, cap, D) for _ in range(L)]; V = [torch.randn(B, Hkv, cap, D) for _ in range(L)]
class SL(DynamicLayer):
    def __init__(s, i, col):
        super().__init__(); s.i, s.col = i, col; s.is_initialized = True; s.dtype = torch.float32; s.device = torch.device("cpu")
    def update(s, k, v, *a, **kw):
        K[s.i][:, :, s.col] = k[:, :, 0]; V[s.i][:, :, s.col] = v[:, :, 0]
        s.keys, s.values = K[s.i][:, :, :s.col + 1], V[s.i][:, :, :s.col + 1]
        return s.keys, s.values
    def get_seq_length(s): return s.col
class SC(Cache):
    def __init__(s, layers): super().__init__(layers=layers)
attn_fn.use(model)
mask = torch.ones(B, 1, 1, T + 1, dtype=torch.bool); mask[:, :, :, 5] = False
masks = [mask] * L
ids = torch.randint(0, 1000, (B, 1)); pos = torch.full((B, 1), T)

# fused weights
lays = []
for lay in model.model.layers:
    a, m = lay.self_attn, lay.mlp
    lays.append(dict(wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous(),
                     wo=a.o_proj.weight.detach(), wgu=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().contiguous(),
                     wd=m.down_proj.weight.detach(), n1=lay.input_layernorm.weight.detach(), n2=lay.post_attention_layernorm.weight.detach(), mod=a))
eps = cfg.rms_norm_eps
emb = model.model.embed_tokens.weight.detach(); nf = model.model.norm.weight.detach(); head = model.lm_head.weight.detach()
I = cfg.intermediate_size
from transformers.integrations.sdpa_attention import sdpa_attention_forward
@torch.inference_mode()
def fused(ids, pos, col):
    n = ids.shape[1]
    x = F.embedding(ids, emb)
    cos, sin = model.model.rotary_emb(x, pos)         # (B, n, D)
    cos = cos[:, None]; sin = sin[:, None]
    h2 = D // 2
    for i, l in enumerate(lays):
        h = F.rms_norm(x, (C,), l["n1"], eps)
        qkv = lin(h, l["wqkv"]).view(B, n, H + 2 * Hkv, D).transpose(1, 2)   # (B, H+2Hkv, n, D)
        qk, v = qkv[:, :H + Hkv], qkv[:, H + Hkv:]
        x1, x2 = qk[..., :h2], qk[..., h2:]
        qk = qk * cos + torch.cat((-x2, x1), -1) * sin
        q, k = qk[:, :H], qk[:, H:]
        K[i][:, :, col] = k[:, :, 0]; V[i][:, :, col] = v[:, :, 0]
        Kc, Vc = K[i][:, :, :col + 1], V[i][:, :, :col + 1]
        qg = q.reshape(B, Hkv, H // Hkv * n, D)
        o = F.scaled_dot_product_attention(qg, Kc, Vc, attn_mask=masks[i], scale=l["mod"].scaling)  # (B,Hkv,g,D)
        x = x + lin(o.reshape(B, n, H * D), l["wo"])
        h = F.rms_norm(x, (C,), l["n2"], eps)
        gu = lin(h, l["wgu"])
        x = x + lin(F.silu(gu[..., :I]) * gu[..., I:], l["wd"])
    x = F.rms_norm(x[:, -1:], (C,), nf, eps)
    return lin(x, head)[:, -1]

@torch.inference_mode()
def hf(ids, pos, col):
    sc = SC([SL(i, col) for i in range(L)])
    return model(input_ids=ids, position_ids=pos, past_key_values=sc, use_cache=True, logits_to_keep=1, kvlab_masks=masks).logits[:, -1]


MODE = {"m": "linear"}
PK = {}
def lin(x, w):
    m = MODE["m"]
    if m == "linear": return F_linear(x, w)
    key = (m, id(w))
    if key not in PK:
        PK[key] = torch.ops.mkl._mkl_reorder_linear_weight(w, B) if m == "mkl" else torch.ops.mkldnn._reorder_linear_weight(w, B)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkl._mkl_linear(x2, PK[key], w, None, B) if m == "mkl" else torch.ops.mkldnn._linear_pointwise(x2, PK[key], None, "none", [], "")
    return y.view(*x.shape[:-1], -1)
F_linear = F.linear
a = hf(ids, pos, T); b = fused(ids, pos, T)
print("maxdiff", (a - b).abs().max().item(), a.abs().max().item())
def fm(): MODE["m"] = "mkl"; return fused(ids, pos, T)
def fd(): MODE["m"] = "dnn"; return fused(ids, pos, T)
def fl(): MODE["m"] = "linear"; return fused(ids, pos, T)
r0 = fl(); r1 = fm(); r2 = fd(); print("diffs", (r0-r1).abs().max().item(), (r0-r2).abs().max().item(), (a-r0).abs().max().item())
import resource; print("maxrss MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024)
fs = {"hf": lambda: hf(ids, pos, T), "lin": fl, "mkl": fm, "dnn": fd}
for f in fs.values():
    for _ in range(3): f()
ts = {k: [] for k in fs}
names = list(fs)
for r in range(20):
    for name in names[r % 4:] + names[:r % 4]:
        t = time.perf_counter(); fs[name](); ts[name].append(time.perf_counter() - t)
import statistics
for k, v in ts.items(): print(k, round(1000 * statistics.median(v), 1))
