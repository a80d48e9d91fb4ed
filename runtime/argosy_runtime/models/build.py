"""`build_model`: a checkpoint's model, weights loaded, on the device it will run on."""

from __future__ import annotations

from typing import Any

import torch

from argosy_runtime.models.llama import LlamaForCausalLM


def build_model(checkpoint: Any, dtype: torch.dtype, device: torch.device, max_positions: int,
                quant_config: Any = None) -> LlamaForCausalLM:
    """The model of `checkpoint` (a model_loader Checkpoint) on `device`, in eval mode, with
    the device's kernels on (the engine's model and a speculative draft model alike).

    Unquantized weights are allocated on `device` and each checkpoint tensor is copied straight
    into its place: a model for a GPU never has a whole copy in host memory (an 8B bf16 model
    would need 16 GB of it). Quantized layers are built on the CPU, where the quantizers run,
    and moved afterwards.
    """
    if checkpoint.spec.is_encoder:  # BERT / XLM-RoBERTa: models/bert.py
        from argosy_runtime.models.bert import BertModel

        if quant_config is not None:
            raise ValueError("quantization: encoder-only models (BERT, XLM-RoBERTa) are served "
                             "unquantized")
        encoder = BertModel(checkpoint.spec, dtype, device)
        encoder.check_all_loaded(encoder.load_weights(checkpoint.iter_weights()))
        return encoder.eval()
    build_on = device if quant_config is None else torch.device("cpu")
    model = LlamaForCausalLM(checkpoint.spec, dtype, max_positions=max_positions, device=build_on)
    if quant_config is None:
        model.check_all_loaded(model.load_weights(checkpoint.iter_weights()))
    else:
        from argosy_runtime.quantization import load_quantized_weights

        load_quantized_weights(model, checkpoint, quant_config)
    model = model.to(device).eval()
    model.use_device_kernels()
    return model
