"""Small-M weight products on the CPU: F.linear vs MKL packed GEMM vs oneDNN packed, in GB/s of weight streamed
(30 matrices per shape, so they do not sit in cache). Run alone: python docs/measured/packed_step/gemm_rates.py"""
import torch, time, torch.nn.functional as F
torch.manual_seed(0)
def bench(f, n=30):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2]
print(torch._C.has_mkl, torch.backends.mkldnn.is_available())
for M in (1, 8):
  for (N, K) in ((3072, 576), (576, 1536), (49152, 576), (960, 576)):
    x = torch.randn(M, K)
    Ws = [torch.randn(N, K) for _ in range(30 if N < 10000 else 3)]
    gb = sum(w.numel() for w in Ws) * 4 / 1e9
    ref = F.linear(x, Ws[0])
    t1 = bench(lambda: [F.linear(x, w) for w in Ws])
    out = f"{M} {N} {K} linear {gb/t1:.1f}"
    try:
        P = [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in Ws]
        y = torch.ops.mkl._mkl_linear(x, P[0], Ws[0], None, M)
        t2 = bench(lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, M) for p, w in zip(P, Ws)])
        out += f"  mkl_packed {gb/t2:.1f} diff {(y-ref).abs().max().item():.2e}"
    except Exception as e:
        out += f" mkl err {str(e)[:80]}"
    try:
        P2 = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in Ws]
        y = torch.ops.mkldnn._linear_pointwise(x, P2[0], None, "none", [], "")
        t3 = bench(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in P2])
        out += f"  onednn {gb/t3:.1f} diff {(y-ref).abs().max().item():.2e}"
    except Exception as e:
        out += f" dnn err {str(e)[:80]}"
    print(out)
