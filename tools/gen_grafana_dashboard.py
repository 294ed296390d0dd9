#!/usr/bin/env python3
"""Writes deploy/grafana/cushare-dashboard.json (run it after changing a panel; tests/unit/
metrics_consumers_test.cpp checks every metric and label it uses against what the broker exports)."""
import json
import os
panels = []


def panel(kind, title, unit, x, y, w, h, desc, targets, **extra):
    panels.append({
        "type": kind, "title": title, "description": desc,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        **extra,
        "targets": targets,
    })


def ts(title, exprs, unit, x, y, w=12, h=8, desc=""):
    panel("timeseries", title, unit, x, y, w, h, desc,
          [{"refId": chr(65 + i), "expr": e, "legendFormat": l} for i, (e, l) in enumerate(exprs)],
          options={"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]}})


def stat(title, expr, unit, x, y, w=6, h=4, desc=""):
    panel("stat", title, unit, x, y, w, h, desc, [{"refId": "A", "expr": expr}])


I = 'instance=~"$instance"'
T = 'instance=~"$instance", tenant=~"$tenant"'
stat("Brokers up", f'sum(cushare_broker_up{{{I}}})', "none", 0, 0)
stat("Tenants", f'count(cushare_tenant_info{{{I}}})', "none", 6, 0)
stat("Memory outside cushare", f'sum(cushare_device_memory_outside_bytes{{{I}}})', "bytes", 12, 0,
     desc="Held by processes that map no tenant's ledger: no tenant's limit counts it.")
stat("MPS daemons answering", f'sum(cushare_mps_up{{{I}}})', "none", 18, 0)
ts("Device memory", [
    (f'cushare_device_memory_capacity_bytes{{{I}}}', "capacity {{instance}} {{uuid}}"),
    (f'cushare_device_memory_reported_used_bytes{{{I}}}', "used (device) {{instance}} {{uuid}}"),
    (f'cushare_device_memory_used_bytes{{{I}}}', "tenants {{instance}} {{uuid}}"),
    (f'cushare_device_memory_outside_bytes{{{I}}}', "outside cushare {{instance}} {{uuid}}")],
   "bytes", 0, 4, desc="The device's own count beside what the tenants hold and what processes outside cushare hold.")
ts("Device utilisation (every process)", [
    (f'rate(cushare_device_busy_seconds_total{{{I}}}[5m])', "{{instance}} {{uuid}}")], "percentunit", 0, 52,
   desc="Time any process's kernels ran on the device, as NVML counts it per process (under MPS clients overlap).")
ts("Tenant memory used and limit", [
    (f'cushare_tenant_memory_used_bytes{{{T}}}', "{{tenant}} used {{uuid}}"),
    (f'cushare_tenant_memory_limit_bytes{{{T}}}', "{{tenant}} limit {{uuid}}")],
   "bytes", 12, 4)
ts("Tenant memory, fraction of limit", [
    (f'cushare_tenant_memory_used_bytes{{{T}}} / on(instance, tenant, device, uuid) cushare_tenant_memory_limit_bytes{{{T}}}',
     "{{tenant}} {{uuid}}")], "percentunit", 0, 12)
ts("Allocations refused at the limit", [
    (f'rate(cushare_tenant_allocations_denied_total{{{T}}}[5m])', "{{tenant}} {{uuid}}")], "reqps", 12, 12)
ts("GPU time by tenant (busy, charged)", [
    (f'rate(cushare_tenant_gpu_busy_seconds_total{{{T}}}[5m])', "{{tenant}} {{uuid}}")], "percentunit", 0, 20,
   desc="Fraction of each second the tenant's work ran on the device: the larger of what it metered and what the device counted.")
ts("Chargeback share of the device", [
    (f'rate(cushare_tenant_gpu_share_seconds_total{{{T}}}[5m])', "{{tenant}} {{uuid}}")], "percentunit", 12, 20,
   desc="Busy time times the fraction of SMs the tenant could use (its MPS percentage); tenants of a device sum to at most 1.")
ts("Time launches waited for their turn", [
    (f'rate(cushare_tenant_throttled_seconds_total{{{T}}}[5m])', "{{tenant}} {{uuid}}")], "percentunit", 0, 28,
   desc="Compute caps and priorities at work.")
ts("Measured compute share (probes)", [
    (f'cushare_tenant_compute_share{{{T}}} and on(instance, tenant, device, uuid) cushare_tenant_compute_share_trusted{{{T}}} == 1',
     "{{tenant}} {{uuid}}"),
    (f'cushare_tenant_fair_share_target{{{T}}}', "{{tenant}} target {{uuid}}")], "percentunit", 12, 28,
   desc="What the tenant's probe kernels got over the window (once enough rounds back it), beside the fair-share target while it contends.")
ts("Memory the broker charged (hidden, left behind)", [
    (f'cushare_tenant_hidden_bytes{{{T}}}', "{{tenant}} hidden {{uuid}}"),
    (f'cushare_tenant_left_behind_bytes{{{T}}}', "{{tenant}} left behind {{uuid}}")], "bytes", 0, 36)
ts("Ledger tampering and processes taken down", [
    (f'increase(cushare_tenant_tamper_total{{{T}}}[10m])', "{{tenant}} {{kind}}")], "none", 12, 36)
ts("Broker and MPS restarts", [
    (f'changes(cushare_broker_start_time_seconds{{{I}}}[1h])', "broker {{instance}}"),
    (f'increase(cushare_mps_restarts_total{{{I}}}[1h])', "MPS daemon {{instance}}")], "none", 0, 44)
ts("Live processes by tenant", [
    (f'cushare_tenant_processes{{{T}}}', "{{tenant}}")], "none", 12, 44)
ts("Memory by Kubernetes container", [
    (f'cushare_container_memory_used_bytes{{{T}}}', "{{namespace}}/{{pod}}/{{container}} ({{tenant}}) {{uuid}}")],
   "bytes", 12, 52,
   desc="What each tenant's processes in each container hold (pod labels: docs/kubernetes.md); part of the tenant's memory.")
dash = {
    "title": "cushare: GPU sharing",
    "uid": "cushare-gpu-sharing",
    "description": "Tenants' memory, limits, GPU time, probes and the broker's health (docs/operations.md, \"Dashboards and alerts\").",
    "tags": ["cushare", "gpu"],
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "time": {"from": "now-6h", "to": "now"},
    "refresh": "30s",
    "templating": {"list": [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
        {"name": "instance", "type": "query", "label": "broker",
         "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": "label_values(cushare_broker_up, instance)", "includeAll": True, "multi": True, "refresh": 2},
        {"name": "tenant", "type": "query", "label": "tenant",
         "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "query": 'label_values(cushare_tenant_info{instance=~"$instance"}, tenant)', "includeAll": True, "multi": True,
         "refresh": 2},
    ]},
    "panels": [dict(p, id=i + 1) for i, p in enumerate(panels)],
}
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy", "grafana", "cushare-dashboard.json")
with open(out, "w") as fh:
    json.dump(dash, fh, indent=2)
    fh.write("\n")

