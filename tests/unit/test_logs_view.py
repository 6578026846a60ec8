"""job logs: which files belong to which rank, and printing appended lines once."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.cli import logs_view
from unbroken.config.job import JobSpec
from unbroken.errors import UsageError
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.phases import JobPhase, WorkerPhase
from unbroken.state.records import Desired, Job, RankInfo, Worker


def test_appended_lines_print_once_and_a_partial_line_waits_until_the_last_pass(tmp_path: Path, capsys) -> None:
    log = tmp_path / "stdout.log"
    log.write_text("one\ntw")
    offsets: dict[Path, int] = {}
    logs_view._print_new(log, "node-1 rank 0", offsets, partial_too=False)
    assert capsys.readouterr().out == "[node-1 rank 0] one\n"
    with open(log, "a") as f:
        f.write("o\nthree")
    logs_view._print_new(log, "node-1 rank 0", offsets, partial_too=False)
    assert capsys.readouterr().out == "[node-1 rank 0] two\n"
    logs_view._print_new(log, "node-1 rank 0", offsets, partial_too=True)
    assert capsys.readouterr().out == "[node-1 rank 0] three\n"
    logs_view._print_new(log, "node-1 rank 0", offsets, partial_too=True)
    assert capsys.readouterr().out == ""


def _job() -> Job:
    spec = JobSpec.model_validate({"name": "j", "nodes": 2, "procs_per_node": 2, "command": ["-m", "x"]})
    return Job(name="j", spec_json=spec.model_dump_json(), phase=JobPhase.RUNNING)


def _worker(node: str, node_rank: int, ranks: tuple[RankInfo, ...]) -> Worker:
    return Worker(job="j", attempt=0, node=node, node_rank=node_rank, desired=Desired.RUN, phase=WorkerPhase.RUNNING,
                  rdzv_endpoint="127.0.0.1:1", ranks=ranks)


def test_reported_ranks_win_over_the_node_rank_guess(tmp_path: Path) -> None:
    layout = ClusterLayout.at(tmp_path)
    # c10d put global ranks 0 and 1 on node-2 (node_rank 1): the reported mapping is used
    workers = [_worker("node-1", 0, (RankInfo(2, 0, 10), RankInfo(3, 1, 11))),
               _worker("node-2", 1, (RankInfo(0, 0, 12), RankInfo(1, 1, 13)))]
    rank_dir = layout.worker_log_dir("j", 0, "node-2") / "j-attempt-0_abc" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text("hi\n")
    [source] = logs_view.sources(layout, _job(), workers, node=None, rank=1)
    assert source.label == "node-2 rank 1" and source.paths == (rank_dir / "stdout.log",)
    # before any rank reported, torchrun's usual order is the guess
    guessed = logs_view.sources(layout, _job(), [_worker("node-1", 0, ()), _worker("node-2", 1, ())], node=None, rank=3)
    assert [s.label for s in guessed] == ["node-2 rank 3"]
    with pytest.raises(UsageError, match="no rank 7"):
        logs_view.sources(layout, _job(), workers, node=None, rank=7)
    with pytest.raises(UsageError, match="no worker on node node-9"):
        logs_view.sources(layout, _job(), workers, node="node-9", rank=None)
