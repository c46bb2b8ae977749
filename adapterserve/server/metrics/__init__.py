"""Prometheus metrics of the whole server (docs/observability.md).

    series.py        every series: name, kind, labels, help, buckets
    recorder.py      a replica's deltas since its last report (cheap to record into)
    calls.py         the Ingress's view of each call (method, status, adapter, tenant, latency, tokens)
    replica_metrics  an engine replica's: adapter loads and lookups, its engine's report
    reporter.py      sends a replica's numbered batches to the hub about once a second
    hub.py           the MetricsHub deployment: every replica's batches summed (aggregate.py)
    labels.py        which adapter names the `adapter` label shows (top N by traffic)
    exposition.py    Prometheus' text format; gateway.py: vLLM's gauges for the Gateway API
                     Inference Extension
    scrape.py        GET /metrics on the HTTP port; listener.py: the metrics port
"""
