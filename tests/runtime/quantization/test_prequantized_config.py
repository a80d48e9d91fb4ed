"""`quantization_config` fields of GPTQ / AWQ folders read as transformers reads them, and
fields naming layouts we cannot load refused instead of silently ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from argosy_runtime.model_loader import load_checkpoint
from argosy_runtime.quantization import detect_prequantized
from prequant_factory import load_prequantized, reference_weights, write_quantized
from transformers import AwqConfig, GPTQConfig

GROUP = 32



def _set_quantization_config(folder: Path, drop: tuple[str, ...] = (), **changes: object) -> dict:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    qc = config["quantization_config"]
    for key in drop:
        qc.pop(key, None)
    qc.update(changes)
    path.write_text(json.dumps(config))
    return qc


@pytest.mark.parametrize(
    ("written", "drop", "changes"),
    [
        # transformers' GPTQConfig (and gptqmodel's code) name the field `format`
        ("gptq_v2", ("checkpoint_format",), {"format": "gptq_v2"}),
        ("gptq", ("checkpoint_format",), {"format": "gptq"}),
        # the legacy `checkpoint_format` wins over `format` when both are there
        ("gptq", (), {"checkpoint_format": "gptq", "format": "gptq_v2"}),
        ("gptq_v2", (), {"checkpoint_format": "GPTQ_V2", "format": "gptq"}),
    ],
    ids=["format-v2", "format-v1", "checkpoint_format-wins-v1", "checkpoint_format-wins-v2"],
)
def test_gptq_format_field_is_read_like_transformers(float_dir: Path, tmp_path: Path,
                                                     written: str, drop: tuple[str, ...],
                                                     changes: dict) -> None:
    qdir, ref_dir = write_quantized(float_dir, tmp_path / "gptq", "gptq", GROUP,
                                    checkpoint_format=written)
    qc = _set_quantization_config(qdir, drop, **changes)
    assert GPTQConfig.from_dict(dict(qc)).format == written  # the reference's reading
    model = load_prequantized(qdir)
    ref = reference_weights(ref_dir)
    for i, layer in enumerate(model.model.layers):
        # a v2 folder read as v1 (or back) shifts every zero point by one step
        w_ref = ref[f"model.layers.{i}.mlp.down_proj.weight"]
        assert torch.allclose(layer.mlp.down_proj.dequantize(), w_ref, atol=1e-6)


@pytest.mark.parametrize(
    ("drop", "changes", "layout"),
    [
        (("version",), {"format": "gemv"}, "gemv"),
        ((), {"backend": "llm-awq"}, "llm-awq"),
    ],
    ids=["format-gemv", "backend-llm-awq"],
)
def test_awq_layout_named_outside_version_is_refused(float_dir: Path, tmp_path: Path,
                                                     drop: tuple[str, ...], changes: dict,
                                                     layout: str) -> None:
    qdir, _ = write_quantized(float_dir, tmp_path / "awq", "awq", GROUP)
    qc = _set_quantization_config(qdir, drop, **changes)
    assert AwqConfig.from_dict(dict(qc)).format == layout  # not the GEMM layout we read
    with pytest.raises(ValueError, match=f"AWQ version '{layout}' is not supported"):
        detect_prequantized(load_checkpoint(str(qdir)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # gptqmodel: per-module bits / group size / skipped modules
        ({"dynamic": {r"+:.*down_proj": {"bits": 8}}}, "dynamic"),
        ({"dynamic": {r"-:model\.layers\.0\..*": {}}}, "dynamic"),
        # gptqmodel / AutoGPTQ: lm_head.qweight etc. in the checkpoint
        ({"lm_head": True}, "lm_head"),
        # AutoGPTQ's Marlin serialization (another qweight layout)
        ({"is_marlin_format": True}, "is_marlin_format"),
        # gptqmodel packs into int16 / int8 / int64 words on request
        ({"pack_dtype": "int16"}, "pack_dtype='int16'"),
    ],
    ids=["dynamic-bits", "dynamic-skip", "lm_head", "marlin", "pack_dtype"],
)
def test_fields_we_cannot_honour_are_refused(float_dir: Path, tmp_path: Path, changes: dict,
                                             message: str) -> None:
    qdir, _ = write_quantized(float_dir, tmp_path / "gptq", "gptq", GROUP)
    _set_quantization_config(qdir, **changes)
    with pytest.raises(ValueError, match=message):
        detect_prequantized(load_checkpoint(str(qdir)))


def test_default_fields_still_load(float_dir: Path, tmp_path: Path) -> None:
    # What gptqmodel writes for a plain checkpoint: these must not be refused.
    qdir, _ = write_quantized(float_dir, tmp_path / "gptq", "gptq", GROUP)
    _set_quantization_config(qdir, lm_head=False, pack_dtype="int32", dynamic=None,
                             is_marlin_format=False)
    assert detect_prequantized(load_checkpoint(str(qdir))) is not None


@pytest.mark.parametrize(("method", "file", "legacy"), [
    # AutoGPTQ before transformers' integration: no quant_method, v1 layout
    ("gptq", "quantize_config.json", {"bits": 4, "group_size": GROUP, "desc_act": False,
                                      "sym": False, "damp_percent": 0.01}),
    # AutoAWQ's own names
    ("awq", "quant_config.json", {"zero_point": True, "q_group_size": GROUP, "w_bit": 4,
                                  "version": "GEMM"}),
    ("awq", "quantize_config.json", {"zero_point": True, "q_group_size": GROUP, "w_bit": 4,
                                     "version": "GEMM"}),
], ids=["autogptq", "autoawq", "awq-quantize_config"])
def test_a_config_beside_config_json_is_read(float_dir: Path, tmp_path: Path, method: str,
                                             file: str, legacy: dict) -> None:
    """Older exports hold the quantization settings in a file of their own, not in
    config.json (gptqmodel reads them): such a folder loaded as a float model and failed on
    its first qweight tensor."""
    qdir, ref_dir = write_quantized(float_dir, tmp_path / method, method, GROUP)
    config = json.loads((qdir / "config.json").read_text())
    del config["quantization_config"]
    (qdir / "config.json").write_text(json.dumps(config))
    (qdir / file).write_text(json.dumps(legacy))
    model = load_prequantized(qdir)
    ref = reference_weights(ref_dir)
    for i, layer in enumerate(model.model.layers):
        assert torch.allclose(layer.mlp.down_proj.dequantize(),
                              ref[f"model.layers.{i}.mlp.down_proj.weight"], atol=1e-6)
