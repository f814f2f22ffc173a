"""Packed sequences with document masking compute each document exactly as if it were alone.

The model's ``document_ids`` restart RoPE positions and keep attention inside each document, on the readable
attention core and on the speed paths training uses (the chunked core on CPU, torch's fused SDPA on CUDA), for the
logits and for the gradients; and the masked loss of a packed batch equals the loss of the documents alone.
"""

from __future__ import annotations

import pytest
import torch

from scratchlm.model import TransformerLM, kernels
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import positions_in_documents

CONFIG = ModelConfig.preset("tiny", vocab_size=64, context_length=24, qk_norm=True, num_kv_heads=2)


def model_on(path: str) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(CONFIG).double()
    if path == "readable":
        return kernels.readable(model)
    return kernels.apply(model, "cpu", fused_attention=path == "fused")


def test_positions_restart_at_each_document():
    ids = torch.tensor([[7, 7, 7, 9, 9, 2], [1, 1, 1, 1, 1, 1]])
    assert positions_in_documents(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("path", ["readable", "chunked", "fused"])
def test_packed_documents_equal_each_alone(path):
    model = model_on(path)
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 9, 3, 7]  # 24 tokens: one packed row
    documents = [torch.randint(0, 64, (n,), generator=generator) for n in lengths]
    packed = torch.cat(documents)[None]  # (1, 24)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    logits = model(packed, document_ids=document_ids)
    alone = torch.cat([model(doc[None]) for doc in documents], dim=1)
    torch.testing.assert_close(logits, alone, rtol=1e-10, atol=1e-10)
    # gradients: the sum of each document's own loss equals the packed one's
    weights = torch.randn(logits.shape, generator=generator, dtype=torch.float64)
    grads_packed = torch.autograd.grad((logits * weights).sum(), list(model.parameters()))
    starts = [0, 5, 14, 17]
    alone_sum = sum((model(doc[None]) * weights[:, s:s + len(doc)]).sum() for doc, s in zip(documents, starts))
    grads_alone = torch.autograd.grad(alone_sum, list(model.parameters()))
    for packed_grad, alone_grad in zip(grads_packed, grads_alone):
        torch.testing.assert_close(packed_grad, alone_grad, rtol=1e-9, atol=1e-10)


def test_document_ids_with_a_cache_are_refused():
    from scratchlm.model.kv_cache import KVCache

    model = model_on("readable")
    with pytest.raises(ValueError, match="document_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), document_ids=torch.zeros(1, 5, dtype=torch.long))
    cache = KVCache.for_model(model, batch_size=1)
    with pytest.raises(ValueError, match="document_ids"):
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache, document_ids=torch.zeros(1, 4, dtype=torch.long))
