"""A real Prometheus scraping a real local cluster through real faults, and every expression of
the shipped Grafana dashboard evaluated by it.

Real: the cluster (controller, agents, ranks), Debian's Prometheus scraping every endpoint
that ``unbroken cluster status`` lists, once a second, and PromQL evaluated by Prometheus.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus import PromQLError, prometheus_server

from unbroken.state.phases import NodeState
from unbroken.plumbing.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "unbroken.json"


def dashboard_expressions() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def test_prometheus_sees_restarts_node_faults_recoveries_and_every_dashboard_panel_has_data(make_cluster, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "ClusterName": "obs",
        "InstanceGroups": [{"InstanceGroupName": "workers", "InstanceCount": 3, "OnStartDeepHealthChecks": ["InstanceConnectivity"]}],
    }))
    cluster = make_cluster("-f", str(config))
    with prometheus_server(tmp_path / "prometheus") as prom:
        def targets() -> list[dict]:
            """What Prometheus reads: the file_sd file ``cluster status --targets-file`` writes, as a user would."""
            cluster.cli("cluster", "status", "--targets-file", str(prom.targets_file))
            return json.loads(prom.targets_file.read_text())

        listed = targets()
        assert listed == cluster.json("cluster", "status")["metrics"]
        unwritable = cluster.cli("cluster", "status", "--targets-file", "/proc/unbroken/targets.json", check=False)
        assert unwritable.returncode == 2 and "--targets-file /proc/unbroken/targets.json: cannot write it" in unwritable.stderr
        assert {t["labels"]["component"] for t in listed} == {"controller", "agent"} and len(listed) == 4
        wait_until(lambda: all(prom.scraped(t["targets"][0]) for t in listed), 30, "every endpoint scraped and up")

        # A job whose persistent tier cannot be written: its failures are a panel too.
        cluster.submit(tmp_path, "obs", steps=100_000, step_time=0.05, checkpoint={
            "memory": {"keep": 2, "replicas": 1}, "persistent": {"uri": "file:///proc/unbroken-cannot-write-here", "every_steps": 10}})
        cluster.wait_step("obs", 15, 120)
        wait_until(lambda: prom.value('sum(unbroken_job_restarts_total{job="obs"})') == 0, 30,
                   "the job's restart counters scraped at zero before the fault")

        cluster.cli("chaos", "kill-worker", "obs")
        cluster.wait_step("obs", 1, 120, attempt=1)
        restarts = wait_until(lambda: prom.value('sum(increase(unbroken_job_restarts_total{job="obs"}[5m]))') or None, 30,
                              "the restart in Prometheus")
        assert round(restarts) == 1, restarts  # increase() extrapolates a little; the count is one
        wait_until(lambda: prom.value("sum(unbroken_job_recovery_seconds_count)") == 1, 30, "one recovery sample")
        assert prom.value('sum(unbroken_job_retry_budget_remaining{job="obs"})') == 2

        busy = {w.node for w in cluster.workers("obs", 1)}
        spare = next(n.name for n in cluster.store.list_nodes() if n.state is NodeState.SCHEDULABLE and n.name not in busy)
        healthy = f'unbroken_node_health_status{{node="{spare}",status="Schedulable"}}'
        wait_until(lambda: prom.value(healthy) == 1, 30, f"{spare} Schedulable in Prometheus")
        cluster.cli("chaos", "xid", spare, "79")
        flipped = f'max_over_time(unbroken_node_health_status{{node="{spare}",status="UnschedulablePendingReplacement"}}[5m])'

        def left_service() -> bool:
            """Scraped as PendingReplacement; or, when the replacement was quicker than a scrape
            interval, retired: a Retired node is not exported, so its Schedulable series ends."""
            if prom.value(flipped) == 1:
                return True
            return cluster.store.get_node(spare).state is NodeState.RETIRED and prom.value(healthy) is None
        wait_until(left_service, 30, f"{spare} out of service in Prometheus")
        wait_until(lambda: prom.value(f'sum(unbroken_node_faults_total{{node="{spare}",reason="Xid79"}})') == 1, 30, "the Xid fault counted")
        # the replacement joins with an endpoint of its own: Prometheus follows cluster status
        wait_until(lambda: cluster.store.get_node(spare).replaced_by, 30, f"{spare} replaced")
        targets()

        # Every panel of the dashboard: it parses, and (but for the GPU panels, which need NVIDIA GPUs) returns data.
        missing: dict[str, str] = {}

        def all_have_data() -> bool:
            missing.clear()
            for title, expr in dashboard_expressions():
                result = prom.query(expr)  # raises PromQLError if Prometheus refuses it
                if not result and "DCGM_" not in expr:
                    missing[title] = expr
            return not missing

        try:
            wait_until(all_have_data, 90, "data for every dashboard panel", interval=1.0)
        except Exception:
            pytest.fail(f"dashboard panels without data: {missing}")
        cluster.cli("job", "cancel", "obs")


def test_a_dashboard_expression_that_does_not_parse_is_caught(tmp_path):
    """The dashboard test above can fail: a broken expression is refused by Prometheus, not ignored."""
    with prometheus_server(tmp_path / "prometheus") as prom:
        with pytest.raises(PromQLError, match="parse"):
            prom.query("sum by (job (unbroken_job_step)")
        assert prom.query("unbroken_job_step") == []


def test_the_shipped_scrape_configs_keep_the_job_label():
    """The local config passes promtool; both keep the series' own ``job`` label (the training job)."""
    local = ROOT / "deploy" / "prometheus" / "prometheus-local.yml"
    checked = subprocess.run(["promtool", "check", "config", str(local)], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    assert yaml.safe_load(local.read_text())["scrape_configs"][0]["honor_labels"] is True
    monitor = yaml.safe_load((ROOT / "deploy" / "prometheus" / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor" and monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
