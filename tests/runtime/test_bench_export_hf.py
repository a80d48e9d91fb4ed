"""bench/export_hf.py: the HF folder peers (vLLM) read holds the embedded model's weights and a
tokenizer that tokenizes every text as Argosy does, so side-by-side runs see the same tokens."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_export_writes_the_same_weights_and_tokenization(tmp_path: Path) -> None:
    from argosy_runtime.model_loader import load_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "export_hf.py"), "smollm2-135m",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = load_checkpoint("smollm2-135m")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(out))
    # Whitespace before digits is where transformers' own GGUF conversion differs (it drops
    # SmolLM2's digit split): "  12345" is one "  " token then five digits for both here.
    rng = random.Random(0)
    pieces = ["\n", "    ", " ", "\t", "a", "The", "12345", "é", "def", "(", ":", "\n\n", "  ",
              "<|im_start|>"]
    texts = ["  12345", "\n\n12345"] + [
        "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(500)]
    for text in texts:
        assert hf_tokenizer.encode(text) == ours.tokenizer.encode(text), repr(text)
    hf_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    weights = dict(ours.iter_weights())
    for name, tensor in hf_model.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name].to(torch.bfloat16)), name
