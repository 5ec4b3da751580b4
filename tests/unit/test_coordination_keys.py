"""The keys of operators' requests: their witnesses (``Keys.asked_witness``) and the
leader's take marks (``Keys.taken``)."""

from __future__ import annotations

import pytest

from sailor.coordination.keys import Keys


def test_a_request_witness_is_under_the_job_root_and_apart_from_every_request() -> None:
    """Under the job's root (the controller identity the command uses may write there,
    agents may not), outside the prefixes the leader mirrors and deletes from, one per
    request key."""
    keys = Keys(job="j")
    readmit = keys.asked_witness(keys.readmit("r1"))
    clear = keys.asked_witness(keys.clear_bad("r1"))
    assert readmit == "/sailor/j/asked/readmit/r1"
    assert clear == "/sailor/j/asked/clear-bad/r1"
    for w in (readmit, clear):
        assert w.startswith(keys.root) and w.startswith(keys.asked)
        assert not w.startswith((keys.readmits, keys.clear_bads))


def test_a_witness_of_another_jobs_key_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'/sailor/k/readmit/r1' is not under '/sailor/j/'"):
        Keys(job="j").asked_witness(Keys(job="k").readmit("r1"))


def test_a_take_mark_is_under_the_job_root_apart_from_requests_and_witnesses() -> None:
    """The mark of a leader's take (``Keys.taken``): one per request key, outside the
    prefixes the leader mirrors and the commands' witnesses; another job's key refused."""
    keys = Keys(job="j")
    mark = keys.taken(keys.clear_bad("r1"))
    assert mark == "/sailor/j/taken/clear-bad/r1" and mark.startswith(keys.takens)
    assert keys.taken(keys.readmit("r1")) != mark
    assert not mark.startswith((keys.readmits, keys.clear_bads, keys.asked))
    with pytest.raises(ValueError, match=r"'/sailor/k/readmit/r1' is not under '/sailor/j/'"):
        keys.taken(Keys(job="k").readmit("r1"))
