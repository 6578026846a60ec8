"""The two readings of a rank's error: a peer-lost symptom (the controller's), and an error from
the process group (the in-process restart's). Messages are as torch 2.13 and gloo print them."""

from __future__ import annotations

import pytest

from unbroken.rank import symptoms

GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"
NCCL_ABORTED = "NCCL communicator was aborted on rank 1."
OWN_BUG = "mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)"


@pytest.mark.parametrize("text", [GLOO_CLOSED, NCCL_ABORTED, "DistNetworkError: Broken pipe",
                                  "ProcessGroupGloo timed out after 30 s"])
def test_a_lost_peer_reads_as_lost_and_as_from_the_process_group(text: str) -> None:
    assert symptoms.says_peer_lost(text)
    assert symptoms.from_the_process_group(text)


def test_a_gloo_timeout_is_from_the_process_group_without_naming_a_lost_peer() -> None:
    """A hung peer trips the survivor's collective timeout: the survivor stays for the next attempt,
    but the controller blames the hang (it found it), not this rank's message."""
    assert symptoms.from_the_process_group(GLOO_TIMEOUT)
    assert not symptoms.says_peer_lost(GLOO_TIMEOUT)


def test_an_error_of_the_script_itself_is_neither() -> None:
    assert not symptoms.says_peer_lost(OWN_BUG)
    assert not symptoms.from_the_process_group(OWN_BUG)


def test_a_rank_reaped_unread_or_sigtermed_does_not_name_the_cause_yet() -> None:
    assert symptoms.says_exit_unread(f"rank 2 (local rank 0) {symptoms.UNREAD_EXIT} (it reaped the rank first)")
    assert symptoms.says_exit_unread("rank 3 (local rank 1) exited with signal 15 (SIGTERM)")
    assert not symptoms.says_exit_unread("rank 2 (local rank 0) exited with signal 9 (SIGKILL)")
