"""Which nodes a layout may use: a node whose workers keep failing is left out for a while.

Without it a rank that cannot run on a node (a GPU fallen off the bus, a CUDA error at every
launch, a configuration the worker refuses) made the controller abort and relaunch on that
very node forever: ``decide`` is level-triggered and had no memory of who failed. The memory
is the desired state's ``node_health`` (``sailor.schemas.runtime.NodeHealth``) and, for a
failure of the whole job, its ``job_health``, so a new leader inherits it and a replay of the
audit log reproduces it. The rules:

- A failure counts against a node when it began there: the worker's error record
  (``sailor.megatron_patch.errors.failure_record``, the first 2000 characters of its JSON in
  ``AgentStatus.failure``, read by ``controller/failure_text.py``) says ``origin`` local or
  config, or the text is no record at all
  (the supervisor's ``rank N exit C: ...``, a toy worker's record without an origin). A
  ``peer`` failure does not: when one rank dies its peers on other nodes fail too, and they
  are not at fault. A ``peer`` record that names the guilty rank (``culprit``: the sender
  of bytes that do not decode) counts against the node that ran that rank instead, as a
  failure of its own, once reporters on two other nodes named it in the generation (or
  its own failure was reported); named by one alone, against it and the reporter both: a
  dispute (``controller/culprits.py``; node-bound: never "alike", never the job's). Each
  generation counts at most once per node.
- Not against any node, up to a bound: a rank's rendezvous port taken by another process
  on its node (``origin`` rendezvous, ``EADDRINUSE``): the next generation's port is another
  (``controller/rendezvous_ports.py``); past the bound of such aborts in a row, the node's.
- Not by this policy: the checkpoint reader's errors (``CorruptCheckpointError``,
  ``NoCheckpointError``). Whether the checkpoint or the nodes that failed to read it are
  at fault takes two launches (``controller/suspect_checkpoint.py``, which charges them
  with ``CheckpointUnreadable``). Not against any node: a parent-written ``SIGABRT``
  record (NCCL's watchdog giving up on a collective) in a generation where another node
  failed with an error of its own: the watchdog fired because that node's rank was gone.
  Nor, by itself, a SIGABRT in a generation where only SIGABRTs were reported: every
  collective hung (a dead NIC, NCCL's ports blocked), every rank's watchdog fired, and the
  node at fault is not known. Nor one in a generation that lost a placed node (``lost``:
  its VM gone, a notice): the watchdog gave up on that node's ranks.
- A failure of the job, not of its nodes: the same cause (error type and message, numbers
  aside: ranks, sizes, steps differ) reported by at least ``JOB_WIDE_MIN_NODES`` nodes and
  by more than half of the placed nodes — a training config every rank refuses, a plan that
  runs out of memory everywhere, a bug every rank hits; and, however many nodes report it,
  an error the ranks agreed on (``failure_text.AGREED_ERRORS``: non-finite gradients too
  many steps in a row, a divergence). It is counted once per generation
  in ``job_health`` by the same policy: while the job is excluded, no layout is launched.
  An agreed error is counted in a record of its own, one per error type
  (``DesiredState.agreed_health``; ``controller/agreed_health.py``), by the same policy,
  with the step it was reported at:
  ``policy.failures`` of the same agreed error without a generation that trains past its
  step hold the job, whatever hangs or stalls came between (they count in ``job_health``,
  which a generation that reaches RUNNING resets). Sharing one count, two non-finite
  failures and a hang held the job, and non-finite failures alternating with hangs never
  did (each hang's RUNNING reset the count).
  The evidence is the failures reported so far plus the causes already counted for that
  generation, so a node counted before its peers' reports came in is taken back (its count,
  and the exclusion that count set) once they show the cause was the job's; so is a
  configuration error counted against a node in an earlier generation, once the next layout
  fails alike and the job is charged (its peers were stopped before they reached the check).
  A killed worker that outlived SIGKILL (``OutlivedKill``), a missed teardown and a missed
  launch deadline are the node's, however many nodes report them. With one placed node,
  every failure but a configuration error or an agreed one is the node's (a SIGABRT, a
  stalled phase): the planner can move the job to a spare, as the job's hold cannot.
- A hang of the job, which nobody can be blamed for, counts against the job by the same
  policy, so it is relaunched with a backoff and a record, not at full rate forever: only
  SIGABRTs reported, by as many nodes as make a failure alike the job's, no placed node
  lost; and a LOAD or VERIFY deadline no placed node got past, every node alike, once it
  was stretched to its cap (``stall``; which: ``controller/failing_nodes.py``, ``stalled``;
  never LAUNCH: agents ack a Launch once they read the plan, so no ack at all is the
  command bus's or the controller's fault). A node's own failure reported later in that
  generation (or, for the SIGABRTs, a placed node's loss seen later) takes the job's count
  back: the node is charged.
- A node (or the job) is excluded at once when its record says ``retry: false`` (a
  configuration error, which a relaunch cannot mend), or at ``ExclusionPolicy.failures``
  consecutive counted failures. The first exclusion lasts ``exclude_s``, each further one
  twice the previous, up to ``max_exclude_s``: a backoff, so a node that was repaired (or a
  transient fault) comes back without an operator.
- The consecutive count resets when a generation placed on the node trains (VERIFY ->
  RUNNING: every node reported a step past the generation's start); the job's with it,
  unless its last failure is an agreed one: the skipped steps before a
  ``NonFiniteGradientsError`` advance the step, so every such generation "trained". That
  count resets once a generation gets past the step the failure was reported at
  (``NodeHealth.step``). Those resets: ``controller/forgetting.py``.
  Until then a node whose exclusion ran out is on probation: its next failure excludes it
  again, for twice as long.
- A record is forgotten: by an operator (``sailor node readmit``); when the controller's
  training config is no longer the one the current generation ran (a restart with a fixed
  config), for every record whose last failure was a configuration error, and the job's when
  its last failure was one every rank agreed on (a lower learning rate for non-finite
  gradients, fixed data for a bad label); and when its node
  is away, once the record's exclusion ended ``max_exclude_s`` ago (never excluded:
  ``failures`` generations after its last count). A lease flap or an agent restart forgets
  nothing. Those rules: ``controller/forgetting.py``.

Pure: no I/O, no clock (the caller passes ``now``), inputs never modified. Must never import
the agent, torch or ``megatron_patch`` (``failure_text`` reads the record's keys by name).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from sailor.controller import rendezvous_ports
from sailor.controller.agreed_health import charge_agreed
from sailor.controller.culprits import BLAMED, DISPUTED, blame
from sailor.controller.failure_text import (
    AGREED_ERRORS,
    CAUSE_CHARS,
    FailureCause,
    abort_signal,
    error_type,
    parse_failure,
    signature_of,
)
from sailor.controller.health_record import (
    AGREED_WHY,
    JOB,
    ExclusionPolicy,
    count_failure,
    describe,
    exclusion_length,
    held,
    record_signature,
)
from sailor.schemas.runtime import (
    MAX_NODE_LIST,
    Accusations,
    DesiredState,
    NodeHealth,
    SigabrtReports,
)

__all__ = [
    "AGREED_WHY",
    "CHECKPOINT_UNREADABLE",
    "DEADLINE_MISSED",
    "JOB",
    "JOB_WIDE_MIN_NODES",
    "Charged",
    "ExclusionPolicy",
    "charge",
    "count_failure",
    "describe",
    "excluded",
    "exclusion_length",
    "forgiven",
    "held",
    "miss_teardown",
    "stall",
    "take_back",
]

JOB_WIDE_MIN_NODES = 2
"""Fewest nodes whose failures alike make them the job's (and more than half of the placed
nodes): one node's failure is always its own, even in a one-node layout."""

_CONFIG = (
    "the job's: a configuration error on several nodes, and no placed node trained with that config"
)

TEARDOWN_MISSED = "TeardownMissed"
"""Error type of the cause a node is charged with when it holds up a teardown past its
deadline (``miss_teardown``)."""

DEADLINE_MISSED = "DeadlineMissed"
"""Error type of the cause a placed node is charged with at a LAUNCH, LOAD or VERIFY deadline
it held up (``controller/failing_nodes.py``: ``missed_launching``); counted by the policy."""

CHECKPOINT_UNREADABLE = "CheckpointUnreadable"
"""Error type of the cause a node is charged with when it failed to read a checkpoint the
other placed nodes read (``controller/suspect_checkpoint.py``): its mount is suspected."""

_NODE_BOUND = (
    "OutlivedKill",
    TEARDOWN_MISSED,
    DEADLINE_MISSED,
    CHECKPOINT_UNREADABLE,
    BLAMED,
    DISPUTED,
)
"""Error types that are about a process or an agent on that node, however many report one."""


def take_back(rec: NodeHealth, now: float) -> NodeHealth | None:
    """``rec`` without the failure counted for its last generation (a node whose failure
    turned out to be the job's, or a peer's; the job's hang that turned out to be a node's
    failure): one fewer, and the exclusion that count set
    ended (a node excluded before that generation was in no layout of it). None when
    nothing is left to remember. Its generation becomes -1: that one is not counted again."""
    set_by_it = rec.excluded_until > now
    exclusions = rec.exclusions - 1 if set_by_it else rec.exclusions
    failures = max(0, rec.failures - 1)
    if failures == 0 and exclusions == 0:
        return None
    return rec.model_copy(
        update={
            "failures": failures,
            "generation": -1,
            "exclusions": exclusions,
            "excluded_until": 0.0 if set_by_it else rec.excluded_until,
        }
    )


@dataclass(frozen=True)
class Charged:
    """The records after a generation's failures were counted, and one sentence per change
    worth a reason (an exclusion, a failure taken back or given to the job)."""

    health: dict[str, NodeHealth]
    job: NodeHealth
    notes: list[str] = field(default_factory=list)
    sigabrts: SigabrtReports | None = None
    """The generation's SIGABRT reports with this pass's added; None: unchanged."""
    agreed: dict[str, NodeHealth] | None = None
    """The job's records of agreed errors (``DesiredState.agreed_health``); None: unchanged."""
    accusations: Accusations | None = None
    """The generation's accusations with this pass's added (``DesiredState.accusations``);
    None: unchanged."""


_SIGABRT_UNNAMED = "Signal: SIGABRT (reported earlier; its summary was not kept)"
"""The cause of kept SIGABRT reports written without one: SIGABRTs all the same."""

_ALIKE = "the job's: most placed nodes failed alike"


def charge(
    d: DesiredState,
    failures: Mapping[str, str],
    now: float,
    policy: ExclusionPolicy,
    progressed: Collection[str] = (),
    lost: Collection[str] = (),
    steps: Mapping[str, int] | None = None,
    held: Mapping[str, str] | None = None,
    stale: Collection[str] = (),
) -> Charged:
    """``d``'s records with the failures of its generation (node -> ``AgentStatus.failure``)
    counted against the nodes they began on, or against the job (module docstring).
    ``progressed``: the placed nodes that reported a step past the generation's start (a
    configuration error is the job's unless another of them trained with that config).
    ``lost``: the placed nodes lost in the generation (gone without notice, or with one):
    the SIGABRTs of the others are NCCL's watchdog giving up on their ranks, not a hang.
    ``steps``: the step each failed node's status reported (``NodeHealth.step``).
    ``held``: the placed nodes whose in-place workers hold a world that broke of a peer's
    fault, node -> a ``peer`` record naming the culprit (``failing_nodes.held_reports``):
    weighed as the failed nodes' accusations are (``controller/culprits.py``).
    ``stale``: the nodes of ``failures`` whose failure is of an older generation (at a
    LAUNCH abort, ``failing_nodes.failed``): a culprit they name is a rank of another
    layout, and is not weighed.

    Called at the abort and at each TEARDOWN pass after it (reports come in late), with the
    failures reported then: a node already counted for the generation is not counted again,
    a node an operator readmitted (:func:`forgiven`) neither, and a generation whose records
    were all forgiven (``DesiredState.forgiven_through``) not at all. The SIGABRTs of
    earlier passes (``DesiredState.sigabrt_reports``, which the result carries on with this
    pass's added) count with those reported now: the Abort clears an agent's failure, and a
    hang whose reports came in over two passes was under the threshold in each. So do the
    accusations of earlier passes (``DesiredState.accusations``, carried on likewise): a
    lone accuser charged at the abort is taken back once a second node's report bears it
    out.
    """
    gen, health, job = d.generation, dict(d.node_health), d.job_health
    if d.forgiven_through >= gen:
        return Charged(health, job)
    causes = {n: parse_failure(t) for n, t in failures.items()}
    # a checkpoint reader's error is judged by controller/suspect_checkpoint.py, not here;
    # a taken rendezvous port is nobody's fault, up to controller/rendezvous_ports.py's bound
    port_free = rendezvous_ports.forgiven(d)
    seen = {
        n: c
        for n, c in causes.items()
        if c.own and not c.unreadable_checkpoint and not (c.port_taken and port_free)
    }
    # a peer's failure that names its guilty rank charges that rank's node as its own
    # failure, when corroborated, or it and the reporter both (controller/culprits.py),
    # weighed with the accusations of the generation's earlier passes
    held_causes = {n: parse_failure(t) for n, t in (held or {}).items() if n not in causes}
    earlier = d.accusations.named if d.accusations.generation == gen else {}
    own_counted = {
        n
        for n, r in health.items()
        if r.generation == gen
        and error_type(r.cause) not in (BLAMED, DISPUTED, TEARDOWN_MISSED)
        and not abort_signal(r.cause)
    }
    spared_nodes = {n for n in d.placement if forgiven(d, n)}
    weighed = {n: c for n, c in (causes | held_causes).items() if n not in stale}
    blamed = blame(d.placement, weighed, earlier, own_counted, spared_nodes)
    seen |= blamed.causes
    notes: list[str] = [
        f"culprit {causes[n].culprit!r} named by {n} ignored: its failure is of an older "
        "generation, whose ranks are another layout's"
        for n in sorted(set(stale) & set(causes))
        if causes[n].origin == "peer" and causes[n].culprit
    ]
    notes += blamed.notes
    # a lone accuser counted in an earlier pass whose accusation is corroborated now
    back = sorted(
        n
        for n in blamed.corroborated
        if n in health and health[n].generation == gen and error_type(health[n].cause) == DISPUTED
    )
    for n in back:
        _take_back_in(health, n, now)
        notes.append(f"taken back from {n}: its accusation of {blamed.named[n]} is borne out")
    kept_named = dict(sorted(blamed.named.items())[:MAX_NODE_LIST])  # bounded, as the schema
    named = Accusations(generation=gen, named=kept_named) if kept_named else None
    # this generation's own failures, node by node: reported now, or counted already
    # (summary, signature, origin)
    evidence: dict[str, tuple[str, str, str]] = {
        n: (c.summary, c.signature, c.origin) for n, c in seen.items()
    }
    for n, r in health.items():
        if r.generation == gen and n not in evidence:
            evidence[n] = (r.cause, record_signature(r), r.origin)
    # the SIGABRTs of earlier passes: an Abort cleared them from the statuses since
    kept = d.sigabrt_reports if d.sigabrt_reports.generation == gen else SigabrtReports()
    if kept.nodes and not abort_signal(kept.cause):  # the schema allows nodes and no cause
        kept = kept.model_copy(update={"cause": _SIGABRT_UNNAMED})
    for n in kept.nodes:
        if n in d.placement and n not in evidence:
            evidence[n] = (kept.cause, signature_of(kept.cause), "unknown")
    kind = {n: error_type(e[0]) for n, e in evidence.items()}
    # what the job is judged by: a readmitted node's failures of the generation are no
    # evidence against the job either (before, its forgiven report and one peer's made a
    # failure "alike" and charged the job); they still explain its peers' SIGABRTs and a
    # stall (the job is spared by them, never charged)
    judged = {n: e for n, e in evidence.items() if not forgiven(d, n)}
    step = max((v for n, v in (steps or {}).items() if n in judged), default=-1)
    aborts = {n for n, e in evidence.items() if abort_signal(e[0])}
    reports = _reports(kept, gen, aborts, evidence)
    # a rank's own error on some node: the SIGABRTs elsewhere are NCCL's watchdog giving up
    # on it (a missed teardown comes after the failure, never before it). SIGABRTs are never
    # "alike": every rank of a job whose collectives hang (a dead NIC) aborts, wherever the
    # fault is.
    first_cause = any(n not in aborts and kind[n] != TEARDOWN_MISSED for n in evidence)
    placed = max(len(d.placement), 1)
    # a one-node job's SIGABRT is its node's, as its other failures are (the planner can
    # move the job to a spare; holding the job moved it nowhere)
    spared_aborts = aborts if placed > 1 else set()
    gone = sorted(set(lost))
    alike = Counter(
        e[1] for n, e in judged.items() if kind[n] not in _NODE_BOUND and n not in aborts
    )
    job_why = {
        sig: _ALIKE for sig, k in alike.items() if k >= JOB_WIDE_MIN_NODES and 2 * k > placed
    }
    job_why |= {e[1]: AGREED_WHY for n, e in judged.items() if kind[n] in AGREED_ERRORS}
    # a bad config fails every node: the first configuration error is the job's, unless
    # another placed node trained with the same config (then it is the node's)
    # (decided when first seen: at a later pass the nodes that trained may be idle already)
    # ... and only when two placed nodes report it (or the job has one node): a ValueError
    # before the first step is a "config" error on one node too (a bad local file, a
    # reshape of nothing), and one node's must not hold a job the others can run
    configs = Counter(e[1] for n, e in judged.items() if e[2] == "config" and n not in aborts)
    for n, e in judged.items():
        first_seen = n not in health or health[n].generation != gen
        shared = configs[e[1]] >= JOB_WIDE_MIN_NODES or placed == 1
        if (
            e[2] == "config"
            and shared
            and first_seen
            and not set(progressed) - {n}
            and n not in aborts
        ):
            job_why.setdefault(e[1], _CONFIG)
    # the job's count for a hang or a stall (below) is never a cause others are "alike" to
    hang_counted = job.generation == gen and abort_signal(job.cause)
    stall_counted = job.generation == gen and error_type(job.cause) == DEADLINE_MISSED
    if job.generation == gen and not hang_counted and not stall_counted:
        job_why.setdefault(record_signature(job), _ALIKE)
    spared: dict[str, list[str]] = {}
    for n in sorted(evidence):
        if forgiven(d, n):  # its failures of this generation are not counted, whatever they say
            continue
        sig = evidence[n][1]
        why = ""
        if n in spared_aborts:
            if first_cause:
                why = "SIGABRT after another node's own failure"
            elif gone:
                why = f"SIGABRT after the loss of {', '.join(gone)}"
            else:
                why = "only SIGABRTs (NCCL's watchdog) reported: the node at fault is not known"
        elif sig in job_why and kind[n] not in _NODE_BOUND:
            why = job_why[sig]
        rec = health.get(n)
        counted = rec is not None and rec.generation == gen
        if why:  # a node-bound record (a missed deadline) stays, whatever the node reports
            if counted and rec is not None and error_type(rec.cause) not in _NODE_BOUND:
                _take_back_in(health, n, now)
                spared.setdefault(why, []).append(f"{n} (taken back)")
            elif n in seen and not counted:
                spared.setdefault(why, []).append(n)
            continue
        if n not in seen or counted:
            continue
        cause = seen[n]
        health[n], excl = count_failure(
            rec or NodeHealth(),
            gen,
            cause.summary,
            cause.origin,
            cause.retry,
            now,
            policy,
            cause.signature,
            (steps or {}).get(n, -1),
        )
        if excl:
            notes.append(describe(n, health[n], now, excl))
        elif kind[n] in (BLAMED, DISPUTED):  # the audit names the culprit, excluded or not
            notes.append(
                f"counted against {n} (failure {health[n].failures} in a row): {health[n].cause}"
            )
    for why, nodes in spared.items():
        notes.append(f"not counted against {', '.join(nodes)}: {why}")
    own = sorted(  # a node's own failure, counted against it (not the job's, nor node-bound)
        n
        for n in evidence
        if n not in aborts and kind[n] not in _NODE_BOUND and evidence[n][1] not in job_why
    )
    if hang_counted and (first_cause or gone):
        # a node's own failure came in after all, or a placed node's loss was seen: the
        # SIGABRTs were the watchdog giving up on its ranks, not a hang of the job
        job = take_back(job, now) or NodeHealth()
        if first_cause:
            who = min(n for n in evidence if n not in aborts and kind[n] != TEARDOWN_MISSED)
            what = f"{who} reported a failure of its own"
        else:
            what = f"{', '.join(gone)} was lost"
        notes.append(
            f"taken back from the job: {what}, the SIGABRTs were NCCL's watchdog giving up "
            "on its ranks"
        )
    elif stall_counted and (own or gone):
        # the stall was a node's failure (an ECC error reported during the teardown), or a
        # node's loss seen late (a dead VM whose lease still held at the deadline)
        job = take_back(job, now) or NodeHealth()
        what = f"{own[0]} reported a failure of its own" if own else f"{', '.join(gone)} was lost"
        notes.append(f"taken back from the job: {what}, the stalled phase was its")
    # only SIGABRTs, by as many placed nodes as make a failure alike the job's, none lost:
    # every collective hung (a dead NIC, NCCL's ports blocked); no node is charged
    hung_on = sorted(n for n in aborts if n in judged)
    many = len(hung_on) >= JOB_WIDE_MIN_NODES and 2 * len(hung_on) > placed
    hung = many and not first_cause and not gone
    # an agreed error is counted in its own record (``agreed_health.charge_agreed``), not
    # the job's; both count by the same rules (``health_record``)
    job_alike = {s: w for s, w in job_why.items() if w != AGREED_WHY}
    agreed = charge_agreed(d, judged, kind, seen, now, policy, step, notes)
    if job_alike and job.generation != gen:
        job, note = _charge_job(job, gen, job_alike, judged, seen, alike, now, policy, step)
        notes.append(note)
        _take_back_earlier(health, evidence, set(job_alike), gen, now, notes)
    elif hung and job.generation != gen:
        # its cause is a SIGABRT's: how a later pass knows which count to take back
        (summary, sig, _), names = evidence[hung_on[0]], ", ".join(hung_on)
        what = (
            f"only SIGABRTs (NCCL's watchdog giving up on a hung collective) reported, by "
            f"{len(hung_on)} of the {placed} placed node(s) ({names}): every collective hung, "
            "the node at fault is not known"
        )
        hang = (summary, "unknown", True, sig)
        job, note = _count_job(job, gen, hang, what, now, policy, step=step)
        notes.append(note)
    same = named is None or named == d.accusations
    return Charged(health, job, notes, reports, agreed, None if same else named)


def _take_back_in(health: dict[str, NodeHealth], node: str, now: float) -> None:
    """``node``'s record in ``health`` without its last generation's count (:func:`take_back`),
    or gone when nothing is left to remember."""
    rec = take_back(health[node], now)
    if rec is None:
        del health[node]
    else:
        health[node] = rec


def _take_back_earlier(
    health: dict[str, NodeHealth],
    evidence: Mapping[str, tuple[str, str, str]],
    signatures: Collection[str],
    gen: int,
    now: float,
    notes: list[str],
) -> None:
    """Take back (in ``health``) the count of an earlier generation's configuration error
    that proves the job's now: a node charged alone with it (its peers were stopped by the
    abort before they reached the same check, or reported it too late to be read) was
    excluded, and the next layout, without it, failed alike: the job is charged, and the
    node was never at fault. Only a configuration error (the same config fails the same
    way everywhere), only one still the node's last failure, not one of this generation
    (the caller's rule takes those back)."""
    back = sorted(
        n
        for n, r in health.items()
        if n not in evidence
        and r.origin == "config"
        and 0 <= r.generation < gen
        and record_signature(r) in signatures
    )
    for n in back:
        _take_back_in(health, n, now)
    if back:
        notes.append(
            f"taken back from {', '.join(back)}: its configuration error of an earlier "
            "generation is the job's (the next layout failed alike)"
        )


def forgiven(d: DesiredState, node: str) -> bool:
    """Whether ``node``'s failures of ``d``'s generation are forgiven: an operator readmitted
    it (``DesiredState.forgiven_nodes``: its record of this generation forgotten), or every
    record of the generation was (``forgiven_through``: ``readmit --all``, a changed training
    config). The record of one node forgotten forgives that node only: one number for the
    whole state spared every other node of the generation, a failure it reported late and a
    teardown it held up past the deadline uncounted."""
    gen = d.generation
    return d.forgiven_through >= gen or d.forgiven_nodes.get(node, -1) >= gen


def _reports(
    kept: SigabrtReports,
    gen: int,
    aborts: Collection[str],
    evidence: Mapping[str, tuple[str, str, str]],
) -> SigabrtReports:
    """The generation's SIGABRT reports once those of this pass (``aborts``) are added to
    ``kept`` (bounded: the first ``MAX_NODE_LIST`` by id)."""
    nodes = tuple(sorted(set(kept.nodes) | set(aborts))[:MAX_NODE_LIST])
    if not nodes:
        return kept
    # a bad record never stops a pass: no cause kept and none reported now, none named
    cause = kept.cause or (evidence[min(aborts)][0][:256] if aborts else _SIGABRT_UNNAMED)
    return SigabrtReports(generation=gen, nodes=nodes, cause=cause)


def _count_job(
    job: NodeHealth,
    gen: int,
    cause: tuple[str, str, bool, str],
    what: str,
    now: float,
    policy: ExclusionPolicy,
    with_cause: bool = True,
    step: int = -1,
) -> tuple[NodeHealth, str]:
    """The job's record with ``gen`` counted for ``cause`` (summary, origin, retry,
    signature) reported at ``step``, and the sentence that says so and ``what`` happened
    (and the summary)."""
    summary, origin, retry, sig = cause
    rec, excl = count_failure(job, gen, summary, origin, retry, now, policy, sig, step)
    if excl:
        return rec, describe(JOB, rec, now, f"{excl}; {what}")
    tail = f": {summary}" if with_cause else ""
    return rec, f"counted against the job (failure {rec.failures} in a row): {what}{tail}"


def _charge_job(
    job: NodeHealth,
    gen: int,
    job_why: Mapping[str, str],
    evidence: Mapping[str, tuple[str, str, str]],
    seen: Mapping[str, FailureCause],
    alike: Counter[str],
    now: float,
    policy: ExclusionPolicy,
    step: int = -1,
) -> tuple[NodeHealth, str]:
    """The job's record with generation ``gen`` counted (reported at ``step``), and the
    sentence that says so."""
    sig = max(sorted(job_why), key=lambda s: alike.get(s, 0))
    nodes = sorted(n for n, e in evidence.items() if e[1] == sig)
    shown = [seen[n] for n in nodes if n in seen]
    origin: str
    if shown:
        summary, origin, retry = shown[0].summary, shown[0].origin, shown[0].retry
    else:  # every one of them was counted before and is idle now: their records say
        summary, origin = evidence[nodes[0]][0], evidence[nodes[0]][2]
        retry = origin != "config"
    if job_why[sig] == _CONFIG:
        what = f"a configuration error on {', '.join(nodes)}, no placed node trained with it"
    else:
        what = f"{len(nodes)} of the placed nodes failed alike ({', '.join(nodes)})"
    return _count_job(job, gen, (summary, origin, retry, sig), what, now, policy, step=step)


def miss_teardown(
    d: DesiredState, late: Mapping[str, str], now: float, policy: ExclusionPolicy
) -> Charged:
    """``d``'s records with each node of ``late`` (node -> what it still reports) charged
    for holding up a teardown past its deadline and excluded at once: its workers may still
    hold its GPUs, and waiting for it held up every launch on the others. Counted for the
    generation unless its failure was counted already; excluded either way."""
    health = dict(d.node_health)
    notes = []
    for n in sorted(late):
        rec = health.get(n, NodeHealth())
        summary = f"{TEARDOWN_MISSED}: {late[n]}"[:CAUSE_CHARS]
        if rec.generation == d.generation:  # its failure is counted: exclude it all the same
            times = rec.exclusions + 1
            rec = rec.model_copy(
                update={
                    "exclusions": times,
                    "excluded_until": now + exclusion_length(policy, times),
                    "cause": summary,
                }
            )
        else:
            rec, _ = count_failure(rec, d.generation, summary, "local", False, now, policy)
        health[n] = rec
        notes.append(describe(n, rec, now, "teardown deadline passed"))
    return Charged(health, d.job_health, notes)


def stall(
    d: DesiredState, job: NodeHealth, what: str, now: float, policy: ExclusionPolicy
) -> tuple[NodeHealth, str]:
    """``job`` (as the abort's other failures left it) with ``d``'s generation counted for a
    LOAD or VERIFY deadline no placed node got past, none to blame more than the others
    (``what``: phase, deadline, how they fell short; ``failing_nodes.stalled``), and the
    sentence that says so; unchanged and '' when the generation is counted against the job
    already, or forgiven (``DesiredState.forgiven_through``), as in :func:`charge`.

    A ``DeadlineMissed`` cause, retried (a rendezvous that never completes may mend): the
    policy's backoff, not a relaunch at full rate forever that no operator sees."""
    gen = d.generation
    if job.generation == gen or d.forgiven_through >= gen:
        return job, ""
    summary = f"{DEADLINE_MISSED}: {what}"[:CAUSE_CHARS]
    cause = (summary, "unknown", True, signature_of(summary))
    return _count_job(job, gen, cause, what, now, policy, with_cause=False)


def excluded(health: Mapping[str, NodeHealth], now: float) -> frozenset[str]:
    """The nodes no layout may use at ``now`` by their records."""
    return frozenset(n for n, r in health.items() if r.excluded_until > now)
