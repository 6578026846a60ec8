"""The web dashboard in a real Chromium (Debian's, driven by Playwright) over a real local cluster
through real faults: the page follows them live, without a reload.

Real: the cluster (controller, agents, ranks), ``unbroken dashboard`` as its own process (uvicorn),
the browser, and, for the token, a network namespace whose address is not loopback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from unbroken.plumbing.netns import NodeNet
from unbroken.state.phases import NodeState
from unbroken.plumbing.waiting import wait_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
UI_TIMEOUT_MS = 60_000
"""How long the page may take to show a change the cluster has made (detection and restart included)."""


@contextmanager
def dashboard(cluster_dir: Path, *args: str, prefix: list[str] | None = None) -> Iterator[str]:
    """``unbroken dashboard`` as a process; yields the URL it prints (with its token, if any)."""
    env = {**os.environ, "UNBROKEN_DIR": str(cluster_dir), "COLUMNS": "400"}
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "unbroken", "dashboard", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the socket is bound and the URL printed (or the process died)
        match = re.search(r"(http://\S+)", line)
        if not match:
            proc.kill()
            raise AssertionError(f"dashboard printed no URL: {line!r}; stderr: {proc.communicate()[1]}")
        yield match.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser) -> Iterator:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def base(url: str) -> str:
    return url.split("?", 1)[0].rstrip("/")


def test_job_page_follows_a_fault_live_and_a_node_page_turns_red(make_cluster, tmp_path, page):
    cluster = make_cluster("--nodes", "3")
    cluster.submit(tmp_path, "live", steps=100_000, step_time=0.05, checkpoint_every=20)
    with dashboard(cluster.dir) as url:
        assert "token" not in url  # loopback: open, like the CLI
        page.goto(f"{base(url)}/jobs/live")
        page.evaluate("window.loadedOnce = true")  # gone if the page ever reloads
        page.wait_for_selector("#live.on")
        page.wait_for_function("document.querySelector('#phase')?.textContent === 'Running'")
        page.wait_for_function("parseInt(document.querySelector('#step').textContent) >= 30")
        assert page.text_content("#restarts") == "0 of 3"
        assert page.locator("#plot polyline.attempt[data-attempt='0']").count() == 1
        # step time by node: both nodes scored from the MLP's sections (docs/stragglers.md), and the hang timeout in force
        page.wait_for_function(r"""(() => { const cells = [...document.querySelectorAll('#step-times tr td:nth-child(3)')];
                                  return cells.length === 2 && cells.every(td => /^[01]\.\d\d$/.test(td.textContent)); })()""")
        assert "hang timeout 60 s (hang_timeout set by the job)" in (page.text_content("#step-time-note") or "")

        # When each phase first shows on the page, by the page's clock (the same machine's).
        page.evaluate("""window.shown = {};
            new MutationObserver(() => document.querySelectorAll('#history li').forEach((li, i) => {
                window.shown[i + ':' + li.className] ??= Date.now() / 1000; }))
            .observe(document.querySelector('#history'), {childList: true, subtree: true});""")
        cluster.cli("chaos", "kill-worker", "live")
        # The phase strip comes from the job's events: a restart quicker than a push still shows.
        page.wait_for_function("""[...document.querySelectorAll('#history li')].map(li => li.className).join(' ')
                                  .includes('step-Running step-Restarting step-Running step-Resumed')""")
        page.wait_for_function("document.querySelector('#restarts').textContent === '1 of 3'")
        shown = page.evaluate("window.shown")
        events = {e.reason: e.ts for e in cluster.store.list_events(object_kind="Job", object_name="live")}
        lag = {"restart": shown["1:step-Restarting"] - events["JobRestarting"], "resume": shown["3:step-Resumed"] - events["JobResumed"]}
        assert all(0 <= seconds < 3 for seconds in lag.values()), f"seconds from the event to the page: {lag}"
        page.wait_for_function("document.querySelector('#phase').textContent === 'Running'")
        page.wait_for_selector("#plot line.marker.fault", state="attached")
        page.wait_for_selector("#plot line.marker.resumed", state="attached")
        page.wait_for_selector("#plot polyline.attempt[data-attempt='1']", state="attached")
        fault_title = page.text_content("#plot line.marker.fault title") or ""
        assert "ChaosKillWorker" in fault_title, fault_title
        assert page.evaluate("window.loadedOnce") is True, "the page reloaded"

        # A spare node turns faulty: its page changes colour while open.
        busy = {w.node for w in cluster.workers("live", 1)}
        spare = next(n.name for n in cluster.store.list_nodes() if n.name not in busy)
        page.goto(f"{base(url)}/nodes/{spare}")
        page.evaluate("window.loadedOnce = true")
        page.wait_for_function("document.querySelector('#health')?.textContent === 'Schedulable'")
        # Every colour the badge takes, as the page renders it (the node may be replaced and retired soon after).
        page.evaluate("""window.colours = [];
            const record = () => { const b = document.querySelector('#title .badge');
                                   if (b) window.colours.push(b.textContent + ' ' + getComputedStyle(b).backgroundColor); };
            new MutationObserver(record).observe(document.querySelector('#title'), {childList: true, subtree: true}); record();""")
        cluster.cli("chaos", "xid", spare, "79")
        page.wait_for_function("window.colours.some(c => c.startsWith('UnschedulablePendingReplacement '))")
        colours = page.evaluate("window.colours")
        assert "Schedulable rgb(31, 136, 61)" in colours and "UnschedulablePendingReplacement rgb(207, 34, 46)" in colours, colours
        assert page.evaluate("window.loadedOnce") is True, "the page reloaded"

        # The overview lists the job with its restart, and the fault in the events.
        page.goto(base(url))
        page.wait_for_selector("#jobs tr[data-name='live']")
        assert "1 of 3" in (page.text_content("#jobs tr[data-name='live']") or "")
        # The spare shows its fault, unless its replacement has already joined and retired it: a few seconds
        # after the Xid, which can be before the overview loads.
        row = f"#nodes tr[data-name='{spare}']"
        wait_until(lambda: cluster.store.get_node(spare).state is NodeState.RETIRED
                   or "health-UnschedulablePendingReplacement" in (page.get_attribute(row, "class") or ""),
                   30, f"{spare} shown pending replacement (or retired)")

        # Unknown names are a 404 page, not a traceback.
        response = page.goto(f"{base(url)}/jobs/no-such-job")
        assert response is not None and response.status == 404
        assert "job no-such-job" in (page.text_content("body") or "") and "Traceback" not in page.content()
        response = page.goto(f"{base(url)}/nodes/node-99")
        assert response is not None and response.status == 404
    cluster.cli("job", "cancel", "live")


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-loopback address in a network namespace needs root")
def test_off_loopback_the_dashboard_needs_its_token(make_cluster, tmp_path, page):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"ClusterName": "web", "InstanceGroups": [{"InstanceGroupName": "g", "InstanceCount": 1}],
                                      "Local": {"NetworkNamespaces": True}}))
    cluster = make_cluster("-f", str(config))
    net = NodeNet(cluster.dir, "node-1")
    with dashboard(cluster.dir, "--host", net.address, prefix=net.exec_prefix()) as url:
        assert url.startswith(f"http://{net.address}:") and "?token=" in url, url  # a token was made and printed
        response = page.goto(base(url) + "/")
        assert response is not None and response.status == 401
        assert "token" in (page.text_content("body") or "")
        api = page.request.get(base(url) + "/api/snapshot")
        assert api.status == 401 and "Bearer" in api.json()["error"]
        wrong = page.goto(base(url) + "/?token=" + "x" * 32)
        assert wrong is not None and wrong.status == 401

        response = page.goto(url)  # the printed URL: the token once, then a cookie
        assert response is not None and response.status == 200
        page.wait_for_selector("#nodes tr[data-name='node-1']")
        response = page.goto(base(url) + "/nodes/node-1")
        assert response is not None and response.status == 200
        page.wait_for_function("document.querySelector('#health')?.textContent === 'Schedulable'")


def test_a_short_token_or_a_taken_port_is_a_clear_error(make_cluster):
    cluster = make_cluster("--nodes", "1")
    short = cluster.cli("dashboard", "--token", "abc", check=False)
    assert short.returncode == 2 and "at least 16" in short.stderr and "Traceback" not in short.stderr
    with dashboard(cluster.dir) as url:
        port = base(url).rsplit(":", 1)[1]
        taken = cluster.cli("dashboard", "--port", port, check=False, timeout=30)
    assert taken.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr, taken.stderr
