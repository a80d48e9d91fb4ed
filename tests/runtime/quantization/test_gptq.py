"""Load-time GPTQ: lower output error than round-to-nearest on the activations it saw."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.models import LlamaForCausalLM
from argosy_runtime.quantization import Int4Linear, QuantizationConfig, load_quantized_weights
from argosy_runtime.quantization.calibration import CALIBRATION_MODULES, calibration_text
from argosy_runtime.quantization.gptq_quantizer import gptq_quantize_int4
from argosy_runtime.quantization.rtn import quantize_int4
from model_factory import make_random_model_dir


def _activations(n: int, k: int, seed: int) -> torch.Tensor:
    # Anisotropic, correlated inputs with a few large channels, like real hidden states.
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, k, generator=g)
    x = torch.randn(n, k, generator=g) @ basis * (torch.rand(k, generator=g) ** 4 * 3)
    x[:, :4] *= 10
    return x


@pytest.mark.parametrize(("k", "group_size"), [(256, 64), (320, 128)])
def test_gptq_lowers_output_error(k: int, group_size: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, k) * 0.05
    x = _activations(1024, k, seed=k)
    gptq = gptq_quantize_int4(w, x.t() @ x, group_size)
    rtn = quantize_int4(w, group_size, clip_search=True)
    assert gptq.input_perm is not None and sorted(gptq.input_perm.tolist()) == list(range(k))
    err_gptq = (x @ (gptq.dequantize() - w).t()).norm()
    err_rtn = (x @ (rtn.dequantize() - w).t()).norm()
    assert err_gptq < 0.7 * err_rtn
    # and the packed layer computes exactly the dequantized GPTQ weight
    layer = Int4Linear.from_weight(gptq, dtype=torch.float32)
    assert torch.allclose(layer(x[:3]), x[:3] @ gptq.dequantize().t(), rtol=1e-4, atol=1e-3)


def test_calibration_text_is_disjoint_from_quality_test_text() -> None:
    from .test_quality_embedded import EVAL_MODULES

    assert not set(EVAL_MODULES) & set(CALIBRATION_MODULES)
    assert len(calibration_text().split()) > 2000


def test_gptq_through_load_quantized_weights(tmp_path: Path) -> None:
    folder = make_random_model_dir(tmp_path, "llama", hidden_size=64, intermediate_size=128,
                                   init_std=0.05)
    ckpt = load_checkpoint(str(folder))
    reference = LlamaForCausalLM(ckpt.spec, torch.float32)
    reference.load_weights(ckpt.iter_weights())
    model = LlamaForCausalLM(ckpt.spec, torch.float32)
    load_quantized_weights(model, ckpt, QuantizationConfig("int4", 32, algorithm="gptq"))
    ref_layers = reference.model.layers
    for i, layer in enumerate(model.model.layers):
        for mine, theirs in ((layer.self_attn.qkv_proj, ref_layers[i].self_attn.qkv_proj),
                             (layer.mlp.down_proj, ref_layers[i].mlp.down_proj)):
            assert isinstance(mine, Int4Linear) and mine.input_perm is not None
            w = theirs.weight.detach()[:, mine.input_perm]
            assert ((mine.dequantize() - w).norm() / w.norm()) < 0.2


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_calibration_forward_matches_transformers(tmp_path: Path, arch: str) -> None:
    # GPTQ collects each layer's Hessian from calibration activations: they must be the
    # activations the model really computes (Qwen3's q/k norms, Phi-3's fused layers included).
    import transformers
    from argosy_runtime.quantization.calibration import _layer_forward

    folder = make_random_model_dir(tmp_path, arch, hidden_size=64, intermediate_size=128,
                                   init_std=0.05)
    ckpt = load_checkpoint(str(folder))
    model = LlamaForCausalLM(ckpt.spec, torch.float32)
    model.check_all_loaded(model.load_weights(ckpt.iter_weights()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids, output_hidden_states=True).hidden_states
        positions = torch.arange(ids.shape[1]).repeat(ids.shape[0])
        h = model.model.embed_tokens(ids)
        for i, layer in enumerate(model.model.layers[:-1]):  # the last hidden state is normed
            h = _layer_forward(model, layer, h, positions)
            torch.testing.assert_close(h, expected[i + 1], rtol=1e-4, atol=1e-4)
