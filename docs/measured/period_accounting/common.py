"""What ab_every1.py and every_step.py set up alike: the embedded teacher on the CPU in fp32, batch 8, a 4,096-token
random prompt (seed 0) and a policy of the eviction bench at that context."""
import torch

from kvlab.core.models import load_teacher
from kvlab.studies.bench.evict_batch import batch_evict_policies

CL, B = 4096, 8


def setup(name: str):
    """(model, vocab size, prompt ids, policy ``name`` as ``bench evict --batch`` runs it at 4,096)."""
    model = load_teacher("cpu", "float32").model
    g = torch.Generator().manual_seed(0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return model, vocab, torch.randint(0, vocab, (CL,), generator=g).tolist(), batch_evict_policies(CL)[name]
