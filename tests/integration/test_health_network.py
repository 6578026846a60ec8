"""Nodes in their own network namespaces (root): a rate-limited link fails InstanceConnectivity and is named."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest
import yaml

from unbroken.plumbing.netns import NodeNet, namespace_exists

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces, veth and tc need root")


def test_a_100mbit_link_fails_connectivity_and_is_named_while_3_unlimited_runs_pass(make_cluster, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "ClusterName": "netns", "InstanceGroups": [{"InstanceGroupName": "g", "InstanceCount": 3}],
        "Local": {"NetworkNamespaces": True},
    }))
    cluster = make_cluster("-f", str(config))
    nodes = {n["name"]: n for n in cluster.json("node", "list")}
    assert len({n["address"] for n in nodes.values()}) == 3 and not any(n["address"].startswith("127.") for n in nodes.values())
    assert all(namespace_exists(NodeNet(cluster.dir, name)) for name in nodes)
    # Each agent serves its metrics on its namespace's address (bound without a reverse DNS
    # lookup, which has no resolver in there and used to block until the node was declared lost).
    agents = [t for t in cluster.json("cluster", "status")["metrics"] if t["labels"]["component"] == "agent"]
    for target in agents:
        address = target["targets"][0]
        assert address.split(":")[0] == nodes[target["labels"]["node"]]["address"], target
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
            assert b"unbroken_health_check_runs_total" in reply.read()

    # Healthy repeats guard the threshold against false alarms (each is a fresh 3-rank gloo sweep, ~7 s here):
    # three (the suite's time budget; five cost 14 s more), and the run after the limit is cleared is a fourth.
    healthy = cluster.cli("check", "collective", "--nodes", "node-1,node-2,node-3", "-b", "64K", "-e", "1M", "-f", "4",
                          "--repeat", "3", "-o", "json", timeout=300)
    report = json.loads(healthy.stdout)
    assert report["status"] == "Pass" and report["metrics"]["runs"] == 3 and report["metrics"]["runs_failed"] == 0, report["metrics"]

    cluster.cli("chaos", "slow-link", "node-3", "100mbit")
    tc = subprocess.run(["tc", "qdisc", "show", "dev", NodeNet(cluster.dir, "node-3").host_veth], capture_output=True, text=True)
    assert "tbf" in tc.stdout and "100Mbit" in tc.stdout, tc.stdout
    slow = cluster.cli("check", "run", "--suite", "InstanceConnectivity", "-o", "json", check=False, timeout=300)
    assert slow.returncode == 1, slow.stderr
    collective = next(r for r in json.loads(slow.stdout) if r["check"] == "collective.allreduce")
    assert collective["status"] == "Fail" and collective["faulty_nodes"] == ["node-3"], collective
    assert collective["message"].startswith("FaultyInstance detected. Replace the instance. busbw below threshold: expected >= ")
    assert "slow node: node-3" in collective["message"]
    print(f"\nhealthy busbw per run: {report['metrics']['per_run_busbw']}; limited: {collective['metrics']['busbw']} GB/s, "
          f"pairs {collective['metrics']['pairs']}")

    cluster.cli("chaos", "slow-link", "node-3", "--clear")
    again = json.loads(cluster.cli("check", "collective", "--nodes", "node-1,node-2,node-3", "-b", "64K", "-e", "1M", "-f", "4",
                                   "-o", "json", check=False).stdout)
    assert again["status"] == "Pass", again["message"]


def test_slow_link_needs_namespaces(make_cluster):
    cluster = make_cluster("--nodes", "1")
    result = cluster.cli("chaos", "slow-link", "node-1", "100mbit", check=False)
    assert result.returncode == 2 and "needs a cluster with Local.NetworkNamespaces: true" in result.stderr
    bad = cluster.cli("chaos", "slow-link", "node-1", check=False)
    assert bad.returncode == 2 and "give a RATE" in bad.stderr
