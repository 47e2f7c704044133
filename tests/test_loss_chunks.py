"""`fxmem.loss_chunks`: a `labels=` model whose logits are returned beside its loss cannot have its
loss chunked; its refusal says so and names keep_outputs=False, which lets it chunk and need less."""
from __future__ import annotations

import pytest
import torch

import fxmem


def test_labels_refusal_names_keep_outputs_false_which_chunks_the_loss():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=2000, n_positions=64, use_cache=False))
    ids = torch.randint(0, 2000, (2, 64))
    kwargs = {"input_ids": ids, "labels": ids}
    with pytest.raises(fxmem.InfeasibleBudgetError) as kept:
        fxmem.plan(model, (), 0.001, example_kwargs=kwargs, time_limit_s=2)
    assert "keep_outputs=False" in str(kept.value) and "\n" not in str(kept.value), kept.value
    with pytest.raises(fxmem.InfeasibleBudgetError) as dropped:
        fxmem.plan(model, (), 0.001, example_kwargs=kwargs, keep_outputs=False, time_limit_s=2)
    assert "chunks of tokens" in str(dropped.value), dropped.value
    assert dropped.value.min_budget_bytes < kept.value.min_budget_bytes
