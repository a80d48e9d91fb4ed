"""The status the timer writes, as the real kopf operator writes it to the emulated API
server (helpers from test_timer_kmock.py): readings that are not current are removed, and the
autoscaler's conditions say which generation of the spec they were computed for."""

from __future__ import annotations

from typing import Any

import pytest
from operator_helpers import Api, eventually
from test_timer_kmock import (
    LLMD_PATH,
    MetricsServer,
    conditions,
    create_scaled_to,
    replica_set_controller,
    status,
)

pytestmark = pytest.mark.timeout(150)

READINGS = ("kvCacheUtilization", "kvCachePercent", "queueDepth")


async def test_readings_are_removed_while_no_replica_can_be_scraped(api: Api,
                                                                     run_operator: Any) -> None:
    server = MetricsServer()
    await server.start()
    server.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}
    try:
        async with replica_set_controller(api, "llm", [server]):
            with run_operator():
                await create_scaled_to(api, "llm", 1)

                async def reading() -> Any:
                    st = await status(api, "llm")
                    return st if st.get("kvCachePercent") == 30 else None

                await eventually(reading, 20, "a reading of 30% KV")
                server.values = None  # the engine died: every scrape fails

                async def blind() -> Any:
                    st = await status(api, "llm")
                    cond = conditions(st).get("ScalingActive", {})
                    return st if cond.get("reason") == "FailedGetMetrics" else None

                st = await eventually(blind, 20, "ScalingActive False / FailedGetMetrics")
                # The last reading of a replica that no longer answers is not its load now.
                assert [k for k in READINGS if k in st] == []
                server.values = {"kv": 0.5, "waiting": 2.0, "running": 2.0}

                async def back() -> Any:
                    st = await status(api, "llm")
                    return st if st.get("kvCachePercent") == 50 else None

                st = await eventually(back, 20, "the reading once scrapes succeed again")
                assert st["queueDepth"] == pytest.approx(2.0)
    finally:
        await server.stop()


async def test_scaling_conditions_carry_the_generation_they_were_computed_for(
        api: Api, run_operator: Any) -> None:
    server = MetricsServer()
    await server.start()
    server.values = {"kv": 0.3, "waiting": 4.0, "running": 4.0}
    try:
        async with replica_set_controller(api, "llm", [server]):
            with run_operator():
                await create_scaled_to(api, "llm", 1)

                async def computed_for_current_generation() -> Any:
                    obj = await api.get_or_none(f"{LLMD_PATH}/llm")
                    conds = conditions((obj or {}).get("status") or {})
                    gen = (obj or {}).get("metadata", {}).get("generation")
                    ours = [conds.get(t, {}).get("observedGeneration")
                            for t in ("ScalingActive", "ScalingLimited")]
                    return gen if "queueDepth" in obj["status"] and ours == [gen, gen] else None

                first = await eventually(computed_for_current_generation, 20,
                                         "conditions with observedGeneration")
                # A spec edit (a new policy): the conditions follow the new generation.
                await api.call("PATCH", f"{LLMD_PATH}/llm",
                               {"spec": {"autoscaling": {"maxReplicas": 3}}})
                second = await eventually(computed_for_current_generation, 20,
                                          "conditions of the edited spec's generation")
                assert second > first
    finally:
        await server.stop()
