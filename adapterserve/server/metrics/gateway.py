"""The gauges the Gateway API Inference Extension's endpoint picker reads, under vLLM's names.

The picker scrapes each endpoint of an InferencePool (a pod's port) and reads, by default:

    vllm:num_requests_waiting   requests queued (gauge)
    vllm:num_requests_running   requests running (gauge)
    vllm:kv_cache_usage_perc    KV-cache blocks in use, 0 to 1 (gauge; older pickers read
                                vllm:gpu_cache_usage_perc, exported too with the same value)
    vllm:lora_requests_info     value: when it was written (seconds since the epoch); labels
                                running_lora_adapters, waiting_lora_adapters (names joined by
                                "," without spaces) and max_lora (adapters it can hold at once)
    vllm:cache_config_info      labels block_size, num_gpu_blocks (value 1)

One endpoint here is one server: its generation engines, summed. Adapters are listed both
as `name@N` and as `name`, the two forms a request's `model` may take.
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from adapterserve.server.metrics.batch import GatewayState
from adapterserve.server.metrics.recorder import AdapterTag


def gateway_families(states: list[GatewayState], public_only: bool, now_s: float) -> list[Metric]:
    """vLLM's gauges for the generation engines in `states` (on the public view, public adapters only)."""
    if not states:
        return []
    model = states[0].backbone
    waiting, running = sum(st.waiting for st in states), sum(st.running for st in states)
    blocks, used = sum(st.kv_blocks for st in states), sum(st.kv_used for st in states)
    usage = used / blocks if blocks else 0.0
    families = [
        _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", model, waiting),
        _gauge("vllm:num_requests_running", "Requests running.", model, running),
        _gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", model, usage),
        _gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0 to 1 (the older name).", model, usage),
    ]
    lora = GaugeMetricFamily("vllm:lora_requests_info", "Adapters in device slots and wanted by waiting requests; "
                             "value: when written.", labels=["running_lora_adapters", "waiting_lora_adapters",
                                                             "max_lora"])
    running_names = _names((a for st in states for a in st.running_adapters), public_only)
    waiting_names = _names((a for st in states for a in st.waiting_adapters), public_only)
    lora.add_metric([running_names, waiting_names, str(sum(st.max_lora for st in states))], now_s)
    cache = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration.",
                              labels=["block_size", "num_gpu_blocks"])
    cache.add_metric([str(states[0].block_size), str(min(st.kv_blocks for st in states))], 1.0)
    return [*families, lora, cache]


def _gauge(name: str, help: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _names(adapters: Iterable[AdapterTag], public_only: bool) -> str:
    return ",".join(sorted({name for name, public in adapters if public or not public_only}))
