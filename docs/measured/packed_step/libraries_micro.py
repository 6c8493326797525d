import time, torch, statistics, torch.nn.functional as F
torch.set_num_threads(2)
shapes={"qkv":(960,576),"o":(576,576),"gate_up":(3072,576),"down":(576,1536)}
M=8
Ws={k:[torch.randn(*s) for _ in range(30)] for k,s in shapes.items()}
packed={k:[torch.ops.mkl._mkl_reorder_linear_weight(w,M) for w in v] for k,v in Ws.items()}
head=torch.randn(49152,576); hp=torch.ops.mkl._mkl_reorder_linear_weight(head,M)
try:
    dn={k:[torch.ops.mkldnn._reorder_linear_weight(w, M) for w in v] for k,v in Ws.items()}
except Exception as e:
    print("mkldnn reorder:", e); dn=None
xs={k:torch.randn(M,s[1]) for k,s in shapes.items()}
def run_fl():
    for k in shapes:
        for w in Ws[k]: F.linear(xs[k], w)
    F.linear(xs["o"], head)
def run_pk():
    for k in shapes:
        for w,p in zip(Ws[k],packed[k]): torch.ops.mkl._mkl_linear(xs[k], p, w, None, M)
    torch.ops.mkl._mkl_linear(xs["o"], hp, head, None, M)
def run_dn():
    for k in shapes:
        for p in dn[k]: torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
fns={"F.linear":run_fl,"mkl packed":run_pk}
if dn is not None: fns["mkldnn packed (no head)"]=run_dn
ts={k:[] for k in fns}
torch.inference_mode().__enter__()
for r in range(30):
    for k,f in fns.items():
        t0=time.perf_counter(); f(); ts[k].append(time.perf_counter()-t0)
nbytes=sum(w.numel()*4 for v in Ws.values() for w in v)+head.numel()*4
for k,v in ts.items():
    m=statistics.median(v); print(k, round(1000*m,2),"ms", round(nbytes/m/1e9,1),"GB/s (incl head)")
