"""Tenants: API keys and per-tenant rate limits in the gateway (docs/gateway.md, "Tenants and
rate limits"). Pure logic, no HTTP; `proxy/tenant_gate.py` ties it to the proxy.

    keys.py         which tenant a bearer key names (constant-time lookup)
    config_file.py  the config file's `tenants` section, re-read while the gateway runs
    key_files.py    the tenants' `api_keys_file`s, re-read while the gateway runs
    limiter.py      requests and tokens per minute (token buckets) and concurrency, per tenant
    usage.py        the tokens an answer used, from its JSON body or SSE stream
"""
