"""bench/adapter_affinity.py without servers: its arguments, the adapters it writes (loaded by
the runtime's own loader), the gateway configs (read back by the gateway's loader), the
request mix, the metric it scrapes and the table. The run itself needs real replicas and a
gateway: see docs/benchmarks/lora.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from argosy_runtime.gateway.config import load_config

# The `bench` fixture (conftest.py) imports it.
SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "adapter_affinity.py"


def test_arguments(bench) -> None:
    args = bench.parse_args([])
    assert args.replicas == 2 and args.max_loaded_loras == 1 and args.adapters == 4
    assert args.rounds == 2 and args.json is None
    for bad in (["--adapters", "0"], ["--max-loaded-loras", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_written_adapters_load_in_the_runtime(bench, tmp_path: Path) -> None:
    import torch
    from argosy_runtime.lora.adapter import LoRAAdapter
    from argosy_runtime.lora.registry import check_registrable
    from argosy_runtime.model_loader import load_checkpoint

    names = bench.adapter_names(2)
    bench.write_adapters(tmp_path, "smollm2-135m", names, rank=4, seed=0)
    spec = load_checkpoint("smollm2-135m").spec
    first, second = (LoRAAdapter.load(n, tmp_path / n, spec, torch.float32) for n in names)
    for name in names:
        check_registrable(name, str(tmp_path / name))
    assert first.rank == 4 and set(first.layers) == set(range(spec.num_hidden_layers))
    # Different weights per adapter: each one's load is its own.
    assert not torch.equal(first.layers[0]["qkv_proj"].a, second.layers[0]["qkv_proj"].a)


def test_gateway_configs_load_and_differ_only_in_adapter_affinity(bench, tmp_path) -> None:
    args = bench.parse_args(["--port", "9330", "--policy", "least-load"])
    urls = ["http://127.0.0.1:9331", "http://127.0.0.1:9332"]
    configs = []
    for affinity in (True, False):
        path = tmp_path / f"{affinity}.yaml"
        path.write_text(bench.yaml.safe_dump(bench.gateway_config(args, urls, affinity)))
        configs.append(load_config(path))
    on, off = configs
    assert on.port == 9330 and [m.backends for m in on.models] == [tuple(urls)]
    assert on.routing.policy == off.routing.policy == "least-load"
    assert on.routing.adapter_affinity and not off.routing.adapter_affinity
    assert on.models == off.models


def test_request_mix_is_seeded_and_uses_every_adapter(bench) -> None:
    args = bench.parse_args(["--requests", "40", "--adapters", "3"])
    mix = bench.request_mix(args, 0)
    assert mix == bench.request_mix(args, 0) != bench.request_mix(args, 1)
    assert {b["model"] for b in mix} == set(bench.adapter_names(3))
    assert all(b["stream"] and b["max_tokens"] == args.output for b in mix)


def test_metric_value_and_table(bench) -> None:
    text = ('# HELP argosy:lora_adapter_loads_total LoRA adapters loaded\n'
            'argosy:lora_adapter_loads_total{model_name="m"} 7.0\n'
            'argosy:lora_adapter_loads_created{model_name="m"} 1.7e9\n')
    assert bench.metric_sum(text, bench.LOADS) == 7.0
    assert bench.metric_sum(text, "argosy:absent_total") is None
    row = {"arm": "affinity-on", "round": 0, "ok": 8, "total": 8, "loads": 3.0,
           "loads_per_replica": [2.0, 1.0], "replicas_per_adapter": {"a": 1, "b": 1, "c": 2},
           "ttft_p50_ms": 150.0, "ttft_p90_ms": 400.0, "wall_s": 1.5, "load_avg": 0.8}
    table = bench.format_table([row]).splitlines()
    assert table[2] == ("| affinity-on | 0 | 8/8 | 3 (2 + 1) | 2 adapters on 1, 1 adapters on "
                        "2 | 150 | 400 | 1.5 | 0.80 |")
    homes = bench.adapter_homes(bench.adapter_names(40), ["http://a:1", "http://b:1"])
    assert sum(homes.values()) == 40 and min(homes.values()) > 0
