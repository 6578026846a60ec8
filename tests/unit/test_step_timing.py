"""Step timing from progress datagrams, the hang timeout it sets, and the straggler scores and
hysteresis it feeds: plain records, real statistics, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from unbroken.agent.progress import ProgressBook
from unbroken.supervision.step_clock import WARMUP_STEPS, WINDOW, RankClock, worker_timing
from unbroken.rank.channel import MessageKind, RankMessage
from unbroken.config.job import JobSpec
from unbroken.controller import hang_timeout, stragglers
from unbroken.state.phases import WorkerPhase
from unbroken.state.records import Desired, RankTiming, StepTiming, Worker


def progress(rank: int, step: int, ts: float, *, pid: int | None = None, attempt: int = 0, **sections: float) -> RankMessage:
    return RankMessage(kind=MessageKind.PROGRESS, job="train", attempt=attempt, rank=rank, local_rank=rank, pid=pid or 100 + rank,
                       ts=ts, step=step, metrics=sections)


def steps(book: ProgressBook, rank: int, count: int, *, every: float, start: float = 0.0, first: int = 1,
          **sections: float) -> float:
    for i in range(count):
        book.apply([progress(rank, first + i, start + i * every, **{f"section:{k}": v for k, v in sections.items()},
                             **{"wait:backward": every / 2})])
    return start + count * every


def timing_of(book: ProgressBook) -> StepTiming:
    report = book.current()[0]
    assert report.step_timing is not None
    return report.step_timing


def test_the_agent_measures_the_median_step_after_the_warmup_and_each_rank_s_scored_sections() -> None:
    book = ProgressBook()
    steps(book, 0, 30, every=0.1, compute=0.04, data=0.01)
    steps(book, 1, 30, every=0.1, compute=0.08, data=0.01)
    timing = timing_of(book)
    assert timing.steps == 30 - 1 - WARMUP_STEPS
    assert timing.median_s == pytest.approx(0.1)
    # compute + data; the backward (waits on peers) is not scored
    assert timing.slowest is not None and timing.slowest.rank == 1 and timing.slowest.work_s == pytest.approx(0.09)
    assert timing.slowest.sections == pytest.approx({"compute": 0.08, "data": 0.01})
    assert timing.work_s == pytest.approx(0.07)  # the median of the node's ranks (0.05 and 0.09)
    assert timing.sections == pytest.approx({"compute": 0.06, "data": 0.01})


def test_a_noisy_step_does_not_move_the_median_but_the_longest_gap_remembers_it() -> None:
    book = ProgressBook()
    end = steps(book, 0, 25, every=0.1, compute=0.05)
    book.apply([progress(0, 26, end + 4.0, **{"section:compute": 2.0})])  # a checkpoint, a GC pause
    steps(book, 0, 5, every=0.1, start=end + 4.1, first=27, compute=0.05)
    timing = timing_of(book)
    assert timing.median_s == pytest.approx(0.1)
    assert timing.work_s == pytest.approx(0.05)
    assert timing.longest_s == pytest.approx(4.1)


def test_the_window_forgets_old_steps_and_a_rank_that_restores_is_measured_afresh() -> None:
    book = ProgressBook()
    end = steps(book, 0, 40, every=0.1, compute=0.05)
    end = steps(book, 0, WINDOW, every=0.3, start=end, first=41, compute=0.25)
    assert timing_of(book).work_s == pytest.approx(0.25)
    steps(book, 0, 2, every=0.1, start=end, first=10)  # went back to step 10: no interval measured yet
    assert book.current()[0].step_timing is None


def test_no_timing_until_every_reporting_rank_has_measured_steps() -> None:
    book = ProgressBook()
    steps(book, 0, 10, every=0.1)
    steps(book, 1, 2, every=0.1)  # still warming up
    assert book.current()[0].step_timing is None


def test_timing_survives_the_store_s_json_and_a_foreign_value_is_no_timing() -> None:
    timing = StepTiming(steps=12, median_s=0.1, longest_s=0.5, work_s=0.05, sections={"compute": 0.04},
                        slowest=RankTiming(3, 0.06, {"compute": 0.05}))
    assert StepTiming.from_json(timing.to_json()) == timing
    assert StepTiming.from_json(StepTiming(12, 0.1, 0.5).to_json()) == StepTiming(12, 0.1, 0.5)
    assert StepTiming.from_json({"steps": "many"}) is None
    assert StepTiming.from_json(["not", "a", "dict"]) is None


# -- the hang timeout in force ----------------------------------------------------------------


def worker(node: str, timing: StepTiming | None, *, step: int = 100) -> Worker:
    return Worker(job="train", attempt=0, node=node, node_rank=0, desired=Desired.RUN, phase=WorkerPhase.RUNNING,
                  rdzv_endpoint="127.0.0.1:1", last_step=step, step_timing=timing)


def spec(**resilience: object) -> JobSpec:
    return JobSpec.model_validate({"name": "train", "command": ["train.py"], "nodes": 2, "resilience": resilience},
                                  context={"trusted": True})


def test_a_job_s_own_hang_timeout_is_used_as_set() -> None:
    timeout = hang_timeout.in_force(spec(hang_timeout=42), [worker("a", StepTiming(50, 0.05, 0.1))])
    assert (timeout.seconds, timeout.why) == (42, "hang_timeout set by the job")


def test_unset_it_is_the_fallback_until_every_worker_has_measured_enough_steps() -> None:
    short = StepTiming(hang_timeout.MIN_STEPS - 1, 0.05, 0.1)
    assert hang_timeout.in_force(spec(), [worker("a", StepTiming(50, 0.05, 0.1)), worker("b", short)]).seconds == hang_timeout.FALLBACK_S
    assert hang_timeout.in_force(spec(), [worker("a", None)]).seconds == hang_timeout.FALLBACK_S


def test_a_spare_pod_that_never_steps_does_not_hold_the_timeout_at_the_fallback() -> None:
    """A job with one spare pod (``unbroken.dev/spare-pods: 1``): its standby worker has no ranks, so no steps; the
    timeout comes from the two that train. Without spare pods the same silent worker keeps the fallback."""
    training = [worker("a", StepTiming(50, 0.05, 0.1)), worker("b", StepTiming(50, 0.05, 0.2))]
    with_spare = hang_timeout.in_force(spec(node_losses_in_place=1), [*training, worker("c", None)])
    assert with_spare.seconds == hang_timeout.FLOOR_S and with_spare.measured
    assert hang_timeout.in_force(spec(), [*training, worker("c", None)]).seconds == hang_timeout.FALLBACK_S
    # two silent workers are more than one spare pod: one of them is a training pod still starting
    assert hang_timeout.in_force(spec(node_losses_in_place=1), [*training, worker("c", None), worker("d", None)]).seconds \
        == hang_timeout.FALLBACK_S


@pytest.mark.parametrize("median, longest, expected", [
    (0.05, 0.2, hang_timeout.FLOOR_S),  # 50 ms steps: the floor
    (2.0, 3.0, 40.0),  # 20 x a 2 s step
    (0.1, 30.0, 60.0),  # a 30 s checkpoint every so many steps: twice it
])
def test_unset_it_follows_the_slowest_worker_s_steps_and_the_longest_gap(median: float, longest: float, expected: float) -> None:
    timeout = hang_timeout.in_force(spec(), [worker("a", StepTiming(50, median, longest)), worker("b", StepTiming(50, median / 2, 0.0))])
    assert timeout.seconds == pytest.approx(expected)
    assert "from step times" in timeout.why


# -- straggler scores and hysteresis ------------------------------------------------------------


def timed(node: str, *work: float, step: int = 100, sections: dict[str, float] | None = None) -> Worker:
    """A worker whose ranks' work is ``work`` (one section, ``compute``, unless given), summed up as its agent does."""
    clocks = {}
    for i, seconds in enumerate(work):
        clock = RankClock()
        for s in range(WARMUP_STEPS + 3):
            clock.observe(s + 1, s * 0.2, {f"section:{k}": v for k, v in (sections or {"compute": seconds}).items()})
        clocks[i + 10 * int(node[-1])] = clock
    timing = worker_timing(clocks)
    assert timing is not None
    return worker(node, replace(timing, steps=20), step=step)


def test_a_slow_node_scores_its_peers_median_over_its_own_and_names_its_slow_section() -> None:
    scores = stragglers.scores([timed("n1", 0.1, 0.1), timed("n2", 0.1, 0.11),
                                timed("n3", 0.1, 0.2, sections={"data": 0.01, "compute": 0.19})])
    # the reference: the median over the other nodes of each node's median rank (0.1 and 0.105)
    assert scores["n3"].score == pytest.approx(0.1025 / 0.2, abs=0.001)
    assert scores["n3"].section == "compute" and scores["n3"].section_score == pytest.approx(0.1025 / 0.19, abs=0.001)
    assert scores["n1"].score == 1.0


def test_a_slowdown_spread_over_every_section_names_no_section() -> None:
    """Each step one of four sections takes 50 ms more (in turn): the work's median doubles, no section's median moves.
    Naming the "slowest" section then named one as fast as its peers' (CI: "slowest section 'forward' at 1")."""
    names = ("data", "forward", "compute", "optimizer")

    def node_timing(node: str, extra: float) -> Worker:
        clock = RankClock()
        for s in range(WARMUP_STEPS + 12):
            clock.observe(s + 1, s * 0.2, {f"section:{n}": 0.01 + (extra if i == s % 4 else 0.0) for i, n in enumerate(names)})
        timing = worker_timing({0: clock})
        assert timing is not None
        return worker(node, replace(timing, steps=20), step=20)

    scores = stragglers.scores([node_timing("n1", 0.0), node_timing("n2", 0.05)])
    assert scores["n2"].score == pytest.approx(0.04 / 0.09, abs=0.001), "the work's median: 90 ms against 40 ms"
    assert (scores["n2"].section, scores["n2"].section_score) == (None, None), scores["n2"]
    assert stragglers.describe(scores["n2"]) == "rank 0 scores 0.444"


def test_a_section_barely_slower_than_its_peers_is_not_named() -> None:
    """CI: a node at 0.738 whose slowest section, 'data', was at 0.967: noise, not where the time went."""
    def slower(compute: float) -> stragglers.NodeScore:
        return stragglers.scores([timed("n1", 0.1, sections={"data": 0.03, "compute": 0.07}),
                                  timed("n2", 0.1, sections={"data": 0.031, "compute": compute})])["n2"]
    assert slower(0.075).section is None, "data at 0.97 and compute at 0.93: neither is named"
    assert (slower(0.1).section, slower(0.1).section_score) == ("compute", 0.7)


def test_two_nodes_suffice_and_a_node_whose_ranks_all_slow_together_is_still_found() -> None:
    scores = stragglers.scores([timed("n1", 0.1, 0.1, 0.1, 0.1), timed("n2", 0.15, 0.15, 0.15, 0.15)])
    assert scores["n2"].score == pytest.approx(0.667, abs=0.01)
    assert scores["n1"].score == 1.0


@pytest.mark.parametrize("values", [[3.0, 1.0], [5.0, 1.0, 4.0], [2.0, 9.0, 4.0, 4.0, 7.0], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
def test_leave_one_out_medians_match_the_median_of_the_others(values: list[float]) -> None:
    import statistics

    expected = [statistics.median(values[:i] + values[i + 1:]) for i in range(len(values))]
    assert stragglers.leave_one_out_medians(values) == pytest.approx(expected)


def test_scoring_two_thousand_nodes_of_eight_ranks_takes_no_time_to_speak_of() -> None:
    import time

    workers = [timed(f"n{i}", *([0.1] * 8)) for i in range(2048)]
    started = time.perf_counter()
    scores = stragglers.scores(workers)
    assert len(scores) == 2048 and time.perf_counter() - started < 2.0


def test_nothing_is_scored_without_sections_or_with_one_node() -> None:
    assert stragglers.scores([timed("n1", 0.1, 0.3)]) == {}
    untimed = [worker("n1", StepTiming(20, 0.2, 0.3)), worker("n2", StepTiming(20, 0.4, 0.5))]
    assert stragglers.scores(untimed) == {}


def test_a_node_is_flagged_after_staying_low_for_the_confirm_steps_and_reports_and_cleared_after_staying_high() -> None:
    watch = stragglers.StragglerWatch()
    slow = {"n2": stragglers.NodeScore("n2", 0.5, 1, "compute")}
    fine = {"n2": stragglers.NodeScore("n2", 0.97, 1, "compute")}
    assert watch.observe("train", 0, 100, slow, 0.75) == []
    assert watch.observe("train", 0, 100, slow, 0.75) == []  # the same report again: a pass with no news
    assert watch.observe("train", 0, 101, slow, 0.75) == []
    assert watch.observe("train", 0, 102, slow, 0.75) == []  # 3 reports, but 2 steps
    [change] = watch.observe("train", 0, 100 + stragglers.CONFIRM_STEPS, slow, 0.75)
    assert (change.node, change.straggler) == ("n2", True)
    assert watch.stragglers("train", 0) == ["n2"]
    assert watch.observe("train", 0, 120, slow, 0.75) == []  # reported once
    assert watch.observe("train", 0, 121, fine, 0.75) == []
    assert watch.observe("train", 0, 122, fine, 0.75) == []
    assert watch.observe("train", 0, 123, fine, 0.75) == []  # 3 reports, but 2 steps
    [back] = watch.observe("train", 0, 121 + stragglers.CONFIRM_STEPS, fine, 0.75)
    assert back.straggler is False and watch.stragglers("train", 0) == []


def test_a_score_that_dips_and_recovers_or_hovers_at_the_line_is_never_flagged() -> None:
    watch = stragglers.StragglerWatch()
    for step in range(100, 300, 2):  # deep under the threshold for two reports of five, healthy for the others
        score = 0.55 if step % 10 in (2, 4) else 1.0
        assert watch.observe("train", 0, step, {"n2": stragglers.NodeScore("n2", score, 1, None)}, 0.75) == []
    for step in range(300, 600, 2):  # a report just under the line, a report just over it
        score = 0.74 if step % 4 else 0.76
        assert watch.observe("train", 0, step, {"n2": stragglers.NodeScore("n2", score, 1, None)}, 0.75) == []


def test_one_healthy_looking_report_of_a_slow_node_pays_back_its_own_worth_not_the_evidence() -> None:
    """A 1.5x node's medians on a shared machine: 0.68, 0.68, 0.80, 0.64. The reports before the 0.80 still count
    (a CUSUM); the rule before it started again from the 0.80 and took a run of low reports more (160 steps in a
    trace of this machine's)."""
    watch = stragglers.StragglerWatch()
    flagged = [step for step, score in zip(range(100, 150, 10), (0.68, 0.68, 0.80, 0.64, 0.68), strict=True)
               if watch.observe("train", 0, step, {"n2": stragglers.NodeScore("n2", score, 1, None)}, 0.75)]
    assert flagged == [130]


def test_a_shallow_dip_must_last_while_a_deep_one_is_flagged_at_once() -> None:
    """The shortfall under the threshold is summed over the reports (a CUSUM): 0.74 for 14 reports is a
    scheduler's noise; 0.67 (a node at 1.5x) is flagged once it has lasted the confirm steps and reports."""
    watch = stragglers.StragglerWatch()
    shallow, deep = stragglers.NodeScore("n1", 0.74, 1, None), stragglers.NodeScore("n2", 0.67, 2, None)
    flagged = {step: [c.node for c in watch.observe("train", 0, step, {"n1": shallow, "n2": deep}, 0.75)] for step in range(100, 300, 10)}
    first = 100 + max(-(-stragglers.CONFIRM_STEPS // 10), stragglers.CONFIRM_REPORTS - 1) * 10
    assert [step for step, nodes in flagged.items() if "n2" in nodes] == [first]
    assert [step for step, nodes in flagged.items() if "n1" in nodes] == [100 + 10 * 14]  # 15 reports x 0.01 = 0.15


def test_only_a_nodes_own_reports_count_as_new_measurements_of_it() -> None:
    """Two agents renew a tenth of a second apart: each renewal moves the job's step, but only the slow node's own
    report measures it again. Counting the other's as a second report flagged a healthy node beside a CPU hog after
    one ~1 s burst (a trace on this machine)."""
    watch = stragglers.StragglerWatch()

    def low(own_step: int) -> dict[str, stragglers.NodeScore]:
        return {"n2": stragglers.NodeScore("n2", 0.55, 1, None, reported_step=own_step)}

    assert watch.observe("train", 0, 100, low(100), 0.75) == []
    assert watch.observe("train", 0, 101, low(101), 0.75) == []
    assert watch.observe("train", 0, 100 + stragglers.CONFIRM_STEPS, low(101), 0.75) == []  # n1's report: no news of n2
    [change] = watch.observe("train", 0, 101 + stragglers.CONFIRM_STEPS, low(101 + stragglers.CONFIRM_STEPS), 0.75)
    assert change.node == "n2" and change.straggler


def test_a_new_attempt_is_measured_afresh() -> None:
    watch = stragglers.StragglerWatch()
    slow = {"n2": stragglers.NodeScore("n2", 0.5, 1, None)}
    for step in (100, 150, 200):
        watch.observe("train", 0, step, slow, 0.75)
    assert watch.stragglers("train", 0) == ["n2"]
    assert watch.observe("train", 1, 201, slow, 0.75) == [] and watch.stragglers("train", 1) == []


@pytest.mark.parametrize("score, running, replace", [(0.5, 120.0, True), (0.5, 50.0, False), (0.9, 200.0, False), (0.9, 400.0, True)])
def test_replacing_is_worth_it_when_the_remaining_run_would_lose_more_than_a_restart(score: float, running: float, replace: bool) -> None:
    assert stragglers.worth_replacing(score, running, 30.0) is replace


def test_a_section_name_that_is_not_a_short_word_is_a_clear_error() -> None:
    from unbroken.train import Context

    ctx = Context.__new__(Context)
    ctx._sections = {}
    with pytest.raises(ValueError, match=r"ctx.section\('Data Loader'\): a section name is a short word"):
        with ctx.section("Data Loader"):
            pass
    with ctx.section("data"):
        pass
    with ctx.section("allreduce", waits_on_peers=True):
        pass
    assert set(ctx._sections) == {"section:data", "wait:allreduce"}


def test_a_new_attempt_keeps_the_last_measured_timeout_until_its_own_steps_are_measured() -> None:
    measured = hang_timeout.in_force(spec(), [worker("a", StepTiming(50, 0.05, 0.1))])
    assert measured.measured and measured.seconds == hang_timeout.FLOOR_S
    fresh = [worker("a", StepTiming(2, 0.05, 0.1))]
    carried = hang_timeout.in_force(spec(), fresh, previous=measured)
    assert carried.seconds == hang_timeout.FLOOR_S and "earlier attempt" in carried.why
    assert hang_timeout.in_force(spec(), fresh).seconds == hang_timeout.FALLBACK_S


def test_the_startup_timeout_follows_the_slowest_startup_seen_unless_the_job_sets_one() -> None:
    started = [replace(worker("a", None), started_at=100.0, first_progress_at=130.0),
               replace(worker("b", None), started_at=100.0, first_progress_at=112.0)]
    assert hang_timeout.observed_startup(started) == 30.0
    assert hang_timeout.observed_startup([*started, replace(worker("c", None), started_at=100.0)]) is None  # c still starting
    assert hang_timeout.startup_in_force(spec(), None).seconds == 600.0
    assert hang_timeout.startup_in_force(spec(), 30.0).seconds == 90.0
    assert hang_timeout.startup_in_force(spec(), 5.0).seconds == hang_timeout.STARTUP_FLOOR_S
    assert hang_timeout.startup_in_force(spec(startup_timeout=42), 30.0).seconds == 42


class _StandInEvent:
    """A CUDA event as the GPU section timer uses one: recorded at a point of the stream, read once the GPU got
    there. The stand-in's "GPU" is a clock the test moves: ``gpu_now`` at ``record()``."""

    gpu_now = 0.0
    made = 0

    def __init__(self) -> None:
        type(self).made += 1
        self.at: float | None = None
        self.synchronized = 0

    def record(self) -> None:
        self.at = type(self).gpu_now

    def synchronize(self) -> None:
        self.synchronized += 1

    def elapsed_time(self, end: "_StandInEvent") -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0


def test_on_a_gpu_sections_report_the_devices_time_one_progress_later_and_the_hosts_beside_it() -> None:
    """On an H100 a forward's kernels took 1.39 ms while its section read 0.28 ms on the host: the straggler
    scores saw where the host waits. With CUDA in use, a section's scored figure is its CUDA-event time."""
    from unbroken.rank.gpu_sections import GpuSections
    from unbroken.train import Context

    sent: list[dict[str, float]] = []
    ctx = Context.__new__(Context)
    ctx._sections, ctx._live = {}, None
    ctx._gpu = GpuSections(_StandInEvent)
    ctx._send = lambda kind, step, metrics=None, detail="": sent.append(dict(metrics or {}))  # type: ignore[method-assign]

    for step, forward_ms in enumerate((5.0, 7.0, 9.0), start=1):
        with ctx.section("forward"):
            _StandInEvent.gpu_now += forward_ms / 1000  # the kernels this section queued run on the device
        with ctx.section("allreduce", waits_on_peers=True):
            _StandInEvent.gpu_now += 0.002
        ctx.progress(step)

    assert "section:forward" not in sent[0], "the first interval is read at the second progress"
    assert sent[1]["section:forward"] == pytest.approx(0.005) and sent[2]["section:forward"] == pytest.approx(0.007)
    assert sent[1]["wait:allreduce"] == pytest.approx(0.002)
    assert all("host:forward" in metrics and "host:allreduce" in metrics for metrics in sent)
    assert _StandInEvent.made == 8, "events are reused once read: 4 per interval, two intervals in flight"
