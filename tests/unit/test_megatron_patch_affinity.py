"""Binding ranks to cores: the core lists, the round robin and the binding itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sailor.megatron_patch.affinity import (
    available_cores,
    format_cores,
    parse_cores,
    round_robin,
)


def test_core_lists_parse_and_print() -> None:
    assert parse_cores("0") == {0}
    assert parse_cores("0,2-4, 7") == {0, 2, 3, 4, 7}
    assert format_cores(parse_cores("3,1-2")) == "1,2,3"


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-2", "1,,2"])
def test_bad_core_lists_name_the_field_and_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=f"--cpu-cores={text!r}"):
        parse_cores(text)


def test_round_robin_places_rank_r_on_core_r_mod_cores() -> None:
    assert round_robin(5, [4, 6]) == [{4}, {6}, {4}, {6}, {4}]
    with pytest.raises(ValueError, match="cores"):
        round_robin(2, [])


def test_bind_binds_the_process_and_refuses_cores_it_may_not_use() -> None:
    core = available_cores()[-1]
    code = (
        "import os; from sailor.megatron_patch.affinity import bind; "
        f"bind(frozenset({{{core}}})); print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"[{core}]"
    bad = max(available_cores()) + 1000
    code = f"from sailor.megatron_patch.affinity import bind; bind(frozenset({{{bad}}}))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0 and f"--cpu-cores={bad}" in res.stderr
    assert len(os.sched_getaffinity(0)) == len(available_cores())  # this process untouched
