"""nccl-tests' formulas and table format, and the collective verdict (which node is slow)."""

from __future__ import annotations

import pytest

from unbroken.errors import UsageError
from unbroken.health.collective.check import blame, judge
from unbroken.health.collective.sweep import Row, algbw, avg_busbw, bus_factor, busbw, format_row, format_table, parse_size, sizes
from unbroken.health.result import Status


@pytest.mark.parametrize(("op", "n", "factor"), [
    ("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("all_gather", 2, 0.5), ("all_gather", 8, 0.875), ("reduce_scatter", 4, 0.75),
])
def test_bus_factor_is_nccl_tests(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bandwidth_uses_decimal_gigabytes():
    assert algbw(1_000_000_000, 1.0) == pytest.approx(1.0)
    assert busbw("all_reduce", 8 << 30, 0.5, 16) == pytest.approx((8 << 30) / 1e9 / 0.5 * 2 * 15 / 16)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 2)


def test_sizes_follow_b_e_f_and_round_to_whole_elements_per_rank():
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("256M") == 256 << 20 and parse_size("1G") == 1 << 30
    assert sizes(8, 256 << 20, 2, ranks=2) == [8 * 2**i for i in range(26)]
    assert sizes(1 << 20, 4 << 20, 4, ranks=3) == [1048572, 4194300]
    with pytest.raises(UsageError, match="'12X' is invalid"):
        parse_size("12X")
    with pytest.raises(UsageError, match="factor >= 2"):
        sizes(8, 64, 1, ranks=2)


def test_rows_print_exactly_like_nccl_tests():
    # all_reduce_perf on 8 H100s: 8 GiB at 34719 us is 247.41 GB/s algbw and 432.97 busbw (2*7/8)
    row = Row(size=8589934592, count=2147483648, dtype="float", op="all_reduce", out_time_us=34719.0, out_wrong=0,
              in_time_us=34720.0, in_wrong=0, ranks=8)
    assert format_row(row) == (
        "  8589934592    2147483648     float     sum      -1    34719  247.41  432.97      0    34720  247.41  432.96      0")
    small = Row(size=8, count=2, dtype="float", op="all_reduce", out_time_us=37.88, out_wrong=0, in_time_us=150.25,
                in_wrong=1, ranks=8)
    assert format_row(small).endswith("    37.88    0.00    0.00      0    150.2    0.00    0.00      1")


def test_table_header_and_footer():
    rows = [Row(size=s, count=s // 4, dtype="float", op="all_gather", out_time_us=1000.0, out_wrong=0, in_time_us=1000.0,
                in_wrong=0, ranks=2) for s in (1 << 20, 2 << 20)]
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[1].startswith("#       size         count      type   redop    root     time   algbw   busbw #wrong")
    assert "    none  " in lines[3]
    assert lines[-3] == "# Out of bounds values : 0 OK"
    expected = avg_busbw(rows)
    assert expected == pytest.approx((1.048576 + 2.097152) / 2 * 0.5)
    assert lines[-2] == f"# Avg bus bandwidth    : {expected:g} "


def _row(op: str, size: int, seconds: float, ranks: int) -> dict:
    us = seconds * 1e6
    return {"size": size, "count": size // 4, "dtype": "float", "op": op, "out_time_us": us, "out_wrong": 0,
            "in_time_us": us, "in_wrong": 0, "ranks": ranks}


def test_judge_passes_above_floor_and_names_the_node_in_every_slow_pair():
    fast = _row("all_reduce", 4 << 20, 0.004, 3)   # ~1.4 GB/s busbw
    slow = _row("all_reduce", 4 << 20, 0.4, 3)     # ~0.014 GB/s
    ok = judge({"runs": [{"attempts": [{"rows": [fast]}]}], "world": 3}, 0.1, ["node-1", "node-2", "node-3"])
    assert ok.status is Status.PASS and ok.metrics["runs_failed"] == 0
    pairs = [{"nodes": ["node-1", "node-2"], "row": _row("all_reduce", 4 << 20, 0.004, 2)},
             {"nodes": ["node-1", "node-3"], "row": _row("all_reduce", 4 << 20, 0.3, 2)},
             {"nodes": ["node-2", "node-3"], "row": _row("all_reduce", 4 << 20, 0.3, 2)}]
    bad = judge({"runs": [{"attempts": [{"rows": [slow]}, {"rows": [slow]}]}], "pairs": pairs, "world": 3}, 0.1,
                ["node-1", "node-2", "node-3"])
    assert bad.status is Status.FAIL and bad.faulty_nodes == ("node-3",)
    assert bad.message.startswith("busbw below threshold: expected >= 0.1, measured 0.0")
    assert "slow node: node-3" in bad.message and bad.metrics["attempts"] == [2]


def test_blame_names_everyone_when_it_cannot_tell():
    assert blame({("a", "b"): 0.01}, 0.1, ["a", "b"]) == ["a", "b"]
    assert blame({}, 0.1, ["a", "b", "c"]) == ["a", "b", "c"]
    assert blame({("a", "b"): 1.0, ("a", "c"): 0.01, ("b", "c"): 1.0}, 0.1, ["a", "b", "c"]) == ["a", "b", "c"]


def test_the_verdict_figure_is_the_fastest_iteration_of_the_better_column():
    row = Row(size=4 << 20, count=1 << 20, dtype="float", op="all_reduce", out_time_us=8000.0, out_wrong=0,
              in_time_us=6000.0, in_wrong=0, ranks=2, out_best_us=5000.0, in_best_us=4194.304)
    assert row.best_busbw == pytest.approx((4 << 20) / 1e9 / 0.004194304)
    assert Row(**{**row.__dict__, "out_best_us": 0.0, "in_best_us": 0.0}).best_busbw == pytest.approx(row.in_busbw)


def _plan() -> dict:
    return {"backend": "gloo", "ops": ["all_reduce"], "sizes": [4096], "iters": 1, "warmup": 0, "repeat": 1,
            "floor": 0.0, "retries": 0}


def test_shares_of_a_sweep_started_apart_meet_at_rank_0_which_alone_gets_the_report():
    """What each pod of the Kubernetes Indexed Job does: start only its node's ranks (real gloo workers here,
    two shares of one rank each on loopback), rendezvous at the first node's address and the given port."""
    from helpers import race
    from unbroken.health.collective.launch import run_sweep
    from unbroken.plumbing.ports import free_port
    from unbroken.health.context import Peer

    port = free_port("127.0.0.1")
    peers = (Peer("joining", "127.0.0.1"), Peer("passed", "127.0.0.1"))
    reports: dict[int, object] = {}
    errors = race(2, lambda i: reports.__setitem__(i, run_sweep(peers, _plan(), share=i, port=port, timeout=60)), timeout=90)
    assert not errors, errors
    assert reports[1] is None, "a peer's share reports nothing: the joining node's judges"
    assert isinstance(reports[0], dict) and reports[0]["world"] == 2, reports[0]


def test_a_share_whose_peer_never_comes_fails_within_its_timeout():
    from unbroken.errors import BackendError
    from unbroken.health.collective.launch import run_sweep
    from unbroken.plumbing.ports import free_port
    from unbroken.health.context import Peer

    peers = (Peer("joining", "127.0.0.1"), Peer("absent", "127.0.0.1"))
    with pytest.raises(BackendError, match="did not finish within 5 s"):
        run_sweep(peers, _plan(), share=0, port=free_port("127.0.0.1"), timeout=5)


def test_a_node_of_one_gpu_passes_on_exact_results_not_on_a_busbw_that_is_zero_by_definition():
    """A healthy one-GPU H100 node failed its join check: one rank's busbw is 0 (2(n-1)/n), below any floor, so
    it was BelowThreshold and Replace. A real sweep of one rank (gloo here, NCCL on a GPU) now passes, with its algbw."""
    from unbroken.health.collective.launch import run_sweep
    from unbroken.health.context import Peer

    report = run_sweep((Peer("one-gpu", "127.0.0.1"),), {**_plan(), "floor": 5.0, "retries": 2}, procs_per_node=1, timeout=60)
    assert isinstance(report, dict) and report["world"] == 1
    assert [len(run["attempts"]) for run in report["runs"]] == [1], "no retries for a floor that cannot apply"
    outcome = judge(report, 5.0, ["one-gpu"])
    assert outcome.status is Status.PASS, outcome.message
    assert outcome.message.startswith("one rank: no link to measure") and outcome.metrics["algbw"] > 0


def test_wrong_elements_fail_the_check_whatever_the_bandwidth():
    row = {**_row("all_reduce", 4 << 20, 0.001, 2), "in_wrong": 3}
    outcome = judge({"runs": [{"attempts": [{"rows": [row]}]}], "world": 2}, 0.1, ["node-1", "node-2"])
    assert outcome.status is Status.FAIL and outcome.reason == "WrongResult" and outcome.metrics["wrong"] == 3
