"""models/build.py: where a model's weights are allocated and loaded."""

from __future__ import annotations

import torch
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.models import LlamaForCausalLM
from argosy_runtime.models.build import build_model


def test_unquantized_weights_load_straight_onto_the_target_device(monkeypatch):
    # The meta device stands in for a GPU: the parameters must already be there when the
    # checkpoint's tensors are copied in, so no whole copy of the model sits in host memory.
    devices_at_load = []
    load_weights = LlamaForCausalLM.load_weights

    def spy(self, weights):
        devices_at_load.append({p.device.type for p in self.parameters()})
        return load_weights(self, weights)

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", spy)
    model = build_model(load_checkpoint("smollm2-135m"), torch.bfloat16, torch.device("meta"),
                        max_positions=64)
    assert devices_at_load == [{"meta"}]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert not model.training


def test_model_storage_is_allocated_in_the_requested_dtype():
    ckpt = load_checkpoint("smollm2-135m")
    model = LlamaForCausalLM(ckpt.spec, torch.bfloat16, max_positions=64, device="meta")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the spec says
