"""Several jobs on one nats-server and one etcd (the tests, the chaos suite, a shared head VM).

A user's permissions in two jobs are the union of what each job gives it, nothing more; the
merged etcd plan keeps every role once and gives each user all of its roles.
"""

from __future__ import annotations

import pytest

from sailor.coordination.keys import Keys
from sailor.coordination.security.etcd_rbac import (
    controller_role,
    merge_plans,
    node_role,
    rbac_plan,
)
from sailor.coordination.security.nats_auth import (
    NatsRole,
    NatsUser,
    nats_authorization_config,
    permissions,
)
from sailor.localservers import Identities

A, B = Keys(job="a"), Keys(job="b")


def test_agent_permissions_in_two_jobs_are_the_union() -> None:
    user = NatsUser("n1", "pw", NatsRole.agent)
    both = permissions((A, B), user)
    assert both["publish"]["allow"] == ["sailor.a.events.n1.>", "sailor.b.events.n1.>"]
    assert both["subscribe"]["allow"] == ["sailor.a.cmd.n1", "sailor.b.cmd.n1", "_INBOX_n1.>"]
    assert permissions(A, user)["publish"]["allow"] == ["sailor.a.events.n1.>"]
    with pytest.raises(ValueError, match="at least one job"):
        permissions((), user)


def test_controller_permissions_in_two_jobs() -> None:
    allow = permissions((A, B), NatsUser("c", "pw", NatsRole.controller))["publish"]["allow"]
    assert allow == ["sailor.a.cmd.*", "sailor.b.cmd.*", "$JS.API.>", "$JS.ACK.>"]


def test_merged_rbac_plan_keeps_each_role_once_and_every_grant() -> None:
    plans = [rbac_plan(k, ("c1",), ("n1", "n2")) for k in (A, B, A)]
    merged = merge_plans(plans)
    names = [r.name for r in merged.roles]
    assert len(names) == len(set(names)) == 6  # controller + 2 nodes, per job
    users = dict(merged.users)
    assert users["n1"] == ("sailor/a/node/n1", "sailor/b/node/n1")
    assert users["c1"] == ("sailor/a/controller", "sailor/b/controller")
    assert users["root"] == ("root",)
    # the old names' grants to take back, once each
    assert merged.legacy == (
        ("c1", "sailor-a-controller"),
        ("n1", "sailor-a-node-n1"),
        ("n2", "sailor-a-node-n2"),
        ("c1", "sailor-b-controller"),
        ("n1", "sailor-b-node-n1"),
        ("n2", "sailor-b-node-n2"),
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # job a's node "b-controller" and job "a-node-b"'s controllers: one old name
        (("a", "node", "b-controller"), ("a-node-b", "controller", "")),
        # job a's node "b-node-c" and job "a-node-b"'s node "c": one old name
        (("a", "node", "b-node-c"), ("a-node-b", "node", "c")),
    ],
    ids=["node-vs-controller", "node-vs-node"],
)
def test_role_names_of_different_identities_never_coincide(
    first: tuple[str, str, str], second: tuple[str, str, str]
) -> None:
    def role(job: str, kind: str, node: str) -> str:
        keys = Keys(job=job)
        return controller_role(keys) if kind == "controller" else node_role(keys, node)

    def old(job: str, kind: str, node: str) -> str:
        return f"sailor-{job}-controller" if kind == "controller" else f"sailor-{job}-node-{node}"

    assert old(*first) == old(*second)  # what the old names did
    assert role(*first) != role(*second)
    plans = [
        rbac_plan(Keys(job=job), ("c1",), (node,) if node else ())
        for job, _, node in (first, second)
    ]
    # every job's roles kept: none taken for another's because of its name (the old names
    # merged two of them into the first one's permissions)
    merged = merge_plans(plans)
    assert len(merged.roles) == sum(len(p.roles) for p in plans)


def test_authorization_only_config_and_its_checks() -> None:
    users = (NatsUser("c", "pw1", NatsRole.controller), NatsUser("n1", "pw2", NatsRole.agent))
    text = nats_authorization_config((A,), users)
    assert "\nauthorization: {" in text and '"user": "n1"' in text
    with pytest.raises(ValueError, match="duplicate"):
        nats_authorization_config(A, (*users, users[0]))


def test_identities_are_distinct_and_not_root() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Identities(controllers=("x",), agents=("x",))
    with pytest.raises(ValueError, match="root"):
        Identities(agents=("root",))
