"""The rules of hvd's negotiation (mpidist/torch/negotiation_rules.py) in one process, without
MPI: the messages of simulated ranks go through the wire's encoding into a Table, and what it
decides is checked against what docs/horovod.md and Horovod's controller state: an operation runs
once every rank not waiting in join() has submitted it, in the order of first submission;
different signatures, or a rank's refusal of its own arguments, refuse it on every rank naming
the ranks; consecutive all-reduces of one dtype, op and device fuse up to the threshold, Adasum's
never, and every fusion hypothesis draws keeps those rules and starts a new buffer only where
the next all-reduce could not join the last. Also the thread's schedule of cycles
(negotiation.py's Negotiator._serve) over scripted cycles and a clock of its own: busy cycles a
cycle time apart, as Horovod's loop; idle pauses that double and that a submit ends at once."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpidist.errors import MismatchError
from mpidist.torch import negotiation
from mpidist.torch.negotiation_rules import (
    REFUSED,
    REFUSED_GROUP,
    Message,
    Refusal,
    Signature,
    Submission,
    Table,
    decode,
    encode,
    group_member,
    signature_of,
    submission_of,
    unnamed_name,
    unnamed_number,
)

NO_FUSION = 0


def allreduce(name, count=4, dtype=torch.float32, op="sum", shape=None):
    return submission_of(name, signature_of("allreduce", torch.zeros(count, dtype=dtype), op, shape=shape,
                                            scale_factors=(1.0, 1.0)))


def message(*submitted, joined=False, expired=(), threshold=NO_FUSION):
    """A rank's message of a cycle, as the other ranks receive it: through the wire's encoding."""
    return decode(encode(Message(tuple(submitted), joined, False, threshold, tuple(expired))))


def names(steps):
    """The names each step runs or refuses, in order."""
    return [["refused", step.name] if isinstance(step, Refusal) else [s.name for s in step.submissions]
            for step in steps]


def test_a_message_crosses_the_wire_as_json_and_back():
    sent = Message((allreduce(group_member("g", 1), shape=[[2, 2]]), submission_of("x", refusal=REFUSED)),
                   True, False, 64, ("y",))
    text = encode(sent)
    # Plain JSON, each record's fields in its order: any JSON reader gets them back by name.
    fields = dict(zip(Message._fields, json.loads(text)))
    member, refused = (dict(zip(Submission._fields, sent)) for sent in fields["submitted"])
    assert dict(zip(Signature._fields, member["signature"]))["dtype"] == "float32"
    assert (member["group"], member["index"]) == ("g", 1)
    assert refused["refusal"] == REFUSED and refused["signature"] is None
    assert fields["fusion_threshold"] == 64 and fields["expired"] == ["y"]
    assert decode(text) == sent


def test_an_operation_runs_once_every_rank_has_submitted_it():
    table = Table(3)
    assert table.cycle([message(allreduce("a")), message(allreduce("a")), message()]).steps == []
    decisions = table.cycle([message(), message(), message(allreduce("a"))])
    assert names(decisions.steps) == [["a"]]
    assert table.pending == {}


def test_an_operation_waits_for_every_training_rank_whoever_else_submitted_it():
    table = Table(3)
    # Rank 1 submitted "a" before it began waiting in join(); rank 2 has not submitted it yet.
    assert table.cycle([message(allreduce("a")), message(allreduce("a"), joined=True), message()]).steps == []
    assert names(table.cycle([message(), message(), message(allreduce("a"))]).steps) == [["a"]]


def test_complete_operations_run_in_the_order_of_first_submission():
    table = Table(2)
    # "b" reached the table first (rank 0's message comes first), though rank 1 submitted "a" first.
    steps = table.cycle([message(allreduce("b"), allreduce("a")), message(allreduce("a"), allreduce("b"))]).steps
    assert names(steps) == [["b"], ["a"]]
    table.cycle([message(allreduce("c")), message()])
    steps = table.cycle([message(allreduce("d")), message(allreduce("d"), allreduce("c"))]).steps
    assert names(steps) == [["c"], ["d"]]


def test_different_signatures_are_refused_on_every_rank_naming_the_ranks():
    table = Table(3)
    steps = table.cycle([message(allreduce("x", count=5)), message(allreduce("x", count=6)),
                         message(allreduce("x", count=5))]).steps
    assert names(steps) == [["refused", "x"]]
    assert isinstance(steps[0].error, MismatchError)
    assert str(steps[0].error) == ("the ranks submitted the hvd operation 'x' with different arguments: "
                                   "count: ranks [0, 2] have 5; ranks [1] have 6 | "
                                   "shape: ranks [0, 2] have (5,); ranks [1] have (6,)")


def test_an_allgathers_row_shape_is_named_so():
    table = Table(2)
    rows = [signature_of("allgather", torch.zeros(3, k), shape=(k,), count=0) for k in (2, 4)]
    steps = table.cycle([message(submission_of("g", rows[0])), message(submission_of("g", rows[1]))]).steps
    assert "row shape (shape[1:]): ranks [0] have (2,); ranks [1] have (4,)" in str(steps[0].error)


def test_a_rank_refusing_its_arguments_refuses_the_operation_on_every_rank():
    table = Table(3)
    steps = table.cycle([message(allreduce("x")), message(submission_of("x", refusal=REFUSED)),
                         message(allreduce("x"))]).steps
    assert names(steps) == [["refused", "x"]]
    assert str(steps[0].error).startswith("ranks [1] refused their arguments to the hvd operation 'x'")


def test_a_refused_name_used_again_meets_the_next_use():
    """A refusal holds no name: the refusing rank's next use of it waits until the refusal is
    resolved, then meets the others' next use."""
    table = Table(2)
    table.cycle([message(), message(submission_of("x", refusal=REFUSED), allreduce("x"))])
    assert [rank for rank, _ in table.deferred] == [1]
    assert names(table.cycle([message(allreduce("x")), message()]).steps) == [["refused", "x"]]
    assert names(table.cycle([message(allreduce("x")), message()]).steps) == [["x"]]


def test_a_group_refused_as_a_whole_refuses_every_member_the_others_submitted():
    table = Table(2)
    members = [allreduce(group_member("g", k), dtype=dtype) for k, dtype in enumerate((torch.float32, torch.int64))]
    other = allreduce("h")
    steps = table.cycle([message(members[1], members[0], other),
                         message(submission_of(group_member("g", 0), refusal=REFUSED_GROUP))]).steps
    assert names(steps) == [["refused", "g.0"]]
    assert [name for name, _ in steps[0].rest] == ["g.1"]
    assert list(table.pending) == ["h"]  # another operation is left as it was


def test_a_member_of_a_refused_group_waits_until_the_refusal_is_resolved():
    table = Table(2)
    table.cycle([message(), message(submission_of(group_member("g", 0), refusal=REFUSED_GROUP),
                                    allreduce(group_member("g", 1)))])
    assert [submission.name for _, submission in table.deferred] == ["g.1"]
    assert "g.1" not in table.pending


def test_unnamed_operations_and_their_groups_count_by_their_number():
    assert unnamed_number(submission_of(unnamed_name(7))) == 7
    assert unnamed_number(submission_of(group_member(unnamed_name(8), 3))) == 8
    assert unnamed_number(submission_of("7")) is None


def fused(threshold, *submissions, ranks=2):
    """The batches of `submissions` submitted together by every rank."""
    table = Table(ranks)
    return names(table.cycle([message(*submissions, threshold=threshold) for _ in range(ranks)]).steps)


def test_all_reduces_fuse_up_to_the_threshold():
    four = [allreduce(f"t{k}") for k in range(4)]  # 16 bytes each
    assert fused(32, *four) == [["t0", "t1"], ["t2", "t3"]]
    assert fused(31, *four) == [["t0"], ["t1"], ["t2"], ["t3"]]
    assert fused(64, *four) == [["t0", "t1", "t2", "t3"]]
    assert fused(NO_FUSION, *four) == [["t0"], ["t1"], ["t2"], ["t3"]]


def test_rank_0s_threshold_decides():
    table = Table(2)
    pair = [allreduce("a"), allreduce("b")]
    steps = table.cycle([message(*pair, threshold=64), message(*pair, threshold=NO_FUSION)]).steps
    assert names(steps) == [["a", "b"]]


def test_a_change_of_dtype_op_device_or_collective_ends_a_fusion():
    assert fused(1 << 20, allreduce("a"), allreduce("b"), allreduce("c", dtype=torch.float64),
                 allreduce("d", dtype=torch.float64)) == [["a", "b"], ["c", "d"]]
    assert fused(1 << 20, allreduce("a"), allreduce("b", op="max"), allreduce("c", op="max")) == [["a"], ["b", "c"]]
    on_meta = submission_of("m", signature_of("allreduce", torch.zeros(4, device="meta"), "sum",
                                              scale_factors=(1.0, 1.0)))
    assert fused(1 << 20, allreduce("a"), on_meta, allreduce("b")) == [["a"], ["m"], ["b"]]
    broadcast = submission_of("x", signature_of("broadcast", torch.zeros(4)))
    assert fused(1 << 20, allreduce("a"), broadcast, allreduce("b")) == [["a"], ["x"], ["b"]]


def test_adasum_is_never_fused():
    assert fused(1 << 20, allreduce("a"), allreduce("s1", op="adasum"), allreduce("s2", op="adasum"),
                 allreduce("b")) == [["a"], ["s1"], ["s2"], ["b"]]


def test_joined_ranks_take_part_in_sums_and_averages_and_refuse_the_rest():
    table = Table(3)
    decisions = table.cycle([message(allreduce("a"), allreduce("b", op="avg"), threshold=64),
                             message(joined=True), message(allreduce("b", op="avg"), allreduce("a"))])
    assert names(decisions.steps) == [["a"], ["b"]]  # different ops: not fused
    assert table.joined == {1} and not decisions.all_joined
    steps = table.cycle([message(allreduce("m", op="max")), message(), message(allreduce("m", op="max"))]).steps
    assert names(steps) == [["refused", "m"]]
    assert str(steps[0].error).startswith("allreduce is not supported with join: ranks [1] have run out of data")
    decisions = table.cycle([message(joined=True), message(), message(joined=True)])
    assert decisions.all_joined and table.joined == set()


def test_an_operation_waited_for_past_the_deadline_names_the_ranks_that_never_submitted_it():
    table = Table(4)
    table.cycle([message(allreduce("x")), message(joined=True), message(allreduce("x")), message()])
    decisions = table.cycle([message(expired=("x",)), message(), message(), message()])
    assert [(s.name, s.missing, s.submitted) for s in decisions.stalled] == [("x", [3], [0, 2])]
    assert "x" not in table.pending


def test_a_table_is_busy_while_something_is_left_to_negotiate():
    """Busy cycles follow each other a cycle time apart; once nothing is left, the thread pauses
    until a submit, which it negotiates at once (a lone hvd call waits for no cycle time)."""
    table = Table(2)
    assert table.cycle([message(allreduce("a")), message()]).busy  # rank 1 has not submitted it
    assert not table.cycle([message(), message(allreduce("a"))]).busy  # it ran: nothing is left
    assert not table.cycle([message(allreduce("b")), message(allreduce("b"))]).busy
    assert table.cycle([message(joined=True), message()]).busy  # a rank waits in join()
    decisions = table.cycle([message(joined=True), message(joined=True)])
    assert decisions.all_joined and not decisions.busy


OPERATIONS = st.tuples(st.sampled_from([torch.float32, torch.float64, torch.int32]),
                       st.sampled_from(["sum", "avg", "max", "adasum"]), st.integers(1, 16))


@settings(max_examples=200, deadline=None)
@given(st.lists(OPERATIONS, min_size=1, max_size=12), st.integers(0, 200))
def test_every_fusion_keeps_the_rules_and_ends_only_where_it_must(operations, threshold):
    submissions = [allreduce(f"t{k}", count, dtype, op) for k, (dtype, op, count) in enumerate(operations)]
    by_name = {submission.name: (dtype, op, count * dtype.itemsize)
               for submission, (dtype, op, count) in zip(submissions, operations)}
    batches = fused(threshold, *submissions)
    assert [name for batch in batches for name in batch] == list(by_name)  # every one, in order

    def fusable(name):
        return threshold > 0 and by_name[name][1] != "adasum"

    for batch in batches:
        if len(batch) > 1:
            assert all(fusable(name) for name in batch), batch
            assert len({by_name[name][:2] for name in batch}) == 1, batch
            assert sum(by_name[name][2] for name in batch) <= threshold, batch
    for before, after in zip(batches, batches[1:]):
        first = after[0]
        could_join = (fusable(first) and all(fusable(name) for name in before)
                      and by_name[first][:2] == by_name[before[0]][:2]
                      and sum(by_name[name][2] for name in before) + by_name[first][2] <= threshold)
        assert not could_join, (before, after)


@pytest.mark.parametrize("collective", ["barrier", "broadcast"])
def test_every_collective_has_one_signature_constructor(collective):
    signature = signature_of(collective, None if collective == "barrier" else torch.zeros(2, 3), root=1)
    assert signature.collective == collective and signature.root == 1
    assert signature.shape == (() if collective == "barrier" else (2, 3))


class Clock:
    """Stands in for the time module in negotiation.py: it moves only when the thread sleeps or
    pauses, so the schedule is exact."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0, seconds
        self.now += seconds


class Wake:
    """Stands in for the thread's wake event: a pause lasts its whole timeout unless a submit set it."""

    def __init__(self, clock):
        self.clock, self.submitted = clock, False

    def set(self):
        self.submitted = True

    def clear(self):
        self.submitted = False

    def wait(self, timeout):
        if not self.submitted:
            self.clock.now += timeout
        return self.submitted


class ScriptedCycles:
    """Stands in for a Negotiator in its thread's loop: each cycle takes `cycle_takes` seconds
    and ends idle or busy as `script` says, (idle, a submit comes during the pause after it)."""

    def __init__(self, script, clock, cycle_seconds, cycle_takes):
        self._script, self._clock = list(script), clock
        self._cycle_seconds, self._cycle_takes = cycle_seconds, cycle_takes
        self._wake, self._idle, self.began = Wake(clock), False, []

    def _cycle(self):
        self.began.append(self._clock.now)
        self._clock.now += self._cycle_takes
        if not self._script:
            return False
        self._idle, submit = self._script.pop(0)
        if submit:
            self._wake.set()
        return True


def test_busy_cycles_begin_a_cycle_time_apart_and_a_submit_ends_an_idle_pause_at_once(monkeypatch):
    """Horovod's loop begins a cycle every HOROVOD_CYCLE_TIME; between idle ones the pause doubles
    from the cycle time up to IDLE_PAUSE_LIMIT_S; a submit during a pause is negotiated in the
    next cycle, begun at once (not a cycle time later, which every hvd call would wait)."""
    clock = Clock()
    monkeypatch.setattr(negotiation, "time", clock)
    cycle, takes = 0.001, 0.0003
    idle, busy = (True, False), (False, False)
    doublings = 9  # 1, 2, 4, ... 256 ms: past the limit
    script = [busy, busy] + [idle] * doublings + [(True, True), busy, idle]
    negotiator = ScriptedCycles(script, clock, cycle, takes)
    negotiation.Negotiator._serve(negotiator)
    gaps = [after - before for before, after in zip(negotiator.began, negotiator.began[1:])]
    assert gaps[:2] == pytest.approx([cycle, cycle])  # the rest of the cycle time, after busy ones
    pauses = [gap - takes for gap in gaps[2:2 + doublings]]
    assert pauses == pytest.approx([min(cycle * 2 ** k, negotiation.IDLE_PAUSE_LIMIT_S) for k in range(doublings)])
    assert pauses[-1] == pytest.approx(negotiation.IDLE_PAUSE_LIMIT_S)
    assert gaps[2 + doublings] == pytest.approx(takes)  # the pause a submit ended: no wait at all
    assert gaps[3 + doublings] == pytest.approx(cycle)  # busy again: a cycle time
    assert gaps[4 + doublings] == pytest.approx(takes + cycle)  # idle again: the pause starts anew
