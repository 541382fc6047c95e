"""The parameter server's wire protocol (mpidist/parallel/ps/protocol.py) in one process, without
MPI: each header record travels in the layout of int64 fields the parameter server has always
sent (written out here number by number, so that a rank of an older version reads it the same),
comes back from a real wire header as the record it was, and a header no rank sends is refused;
the coordinator's orders travel as their command and an int64 payload of ranks; and each kind of
the update policy's decisions becomes the command of the same effect on the other servers."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mpidist.errors import MismatchError
from mpidist.parallel.ps import survival
from mpidist.parallel.ps.policy import Decision, Kind, Policy
from mpidist.parallel.ps.protocol import (
    Command,
    DiedHeader,
    DoneHeader,
    FailedHeader,
    FailureReply,
    Order,
    PullHeader,
    PushHeader,
    RowsReply,
    WeightsReply,
    decode_order,
    decode_push,
    decode_reply,
    encode_order,
    encode_push,
    encode_reply,
    order_of,
)
from mpidist.runtime import wire

PUSHES = (PushHeader, DoneHeader, PullHeader, FailedHeader, DiedHeader)
REPLIES = (WeightsReply, RowsReply, FailureReply)
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1)

# (record, the fields it travels as): a worker's message is [kind, ...], a reply [version, kind, ...],
# with the kinds Push.GRADIENT 0, DONE 1, PULL 2, FAILED 3 and Sent.WEIGHTS 0, ROWS 1, FAILURE 2.
LAYOUTS = [
    (PushHeader(step=3, version=7, stop=1), (0, 3, 7, 1)),
    (DoneHeader(steps=5, version=9), (1, 5, 9)),
    (PullHeader(table=2, version=4), (2, 2, 4)),
    (FailedHeader(code=1, version=6), (3, 1, 6)),
    (WeightsReply(version=8, stopping=1), (8, 0, 1)),
    (RowsReply(version=8), (8, 1)),
    (FailureReply(version=8, code=2, rank=3), (8, 2, 2, 3)),
]


def encode(header) -> tuple:
    return encode_reply(header) if type(header) in REPLIES else encode_push(header)


def decode(header, fields: tuple):
    return decode_reply(fields) if type(header) in REPLIES else decode_push(fields)


def through_the_wire(fields: tuple) -> tuple:
    """The fields as a receiver reads them from the int64 header wire.send makes."""
    return wire.fields_of(wire.header_of(torch.zeros(3), fields))


@pytest.mark.parametrize("header, fields", LAYOUTS, ids=[type(header).__name__ for header, _ in LAYOUTS])
def test_a_header_travels_in_the_layout_it_always_had(header, fields):
    assert wire.header_of(torch.zeros(3), encode(header)).tobytes() == wire.header_of(torch.zeros(3), fields).tobytes()


def records(classes):
    return st.sampled_from(classes).flatmap(
        lambda record: st.tuples(*[INT64] * len(record._fields)).map(lambda values: record(*values)))


@given(header=records(PUSHES + REPLIES))
def test_a_header_comes_back_from_the_wire_as_the_record_it_was(header):
    received = decode(header, through_the_wire(encode(header)))
    assert type(received) is type(header) and tuple(received) == tuple(header)


def test_a_dead_workers_stand_in_reads_as_a_death():
    assert decode_push(survival.Death.fields) == DiedHeader() and type(decode_push(survival.Death.fields)) is DiedHeader


@pytest.mark.parametrize("fields", [(), (9, 1, 2), (0, 1, 2), (1, 5, 9, 0), (4, 0)])
def test_a_message_no_rank_sends_is_refused(fields):
    with pytest.raises(MismatchError, match="no rank of this version"):
        decode_push(fields)


@pytest.mark.parametrize("fields", [(8,), (8, 3), (8, 0), (8, 1, 0), (8, 2, 2)])
def test_a_reply_no_rank_sends_is_refused(fields):
    with pytest.raises(MismatchError, match="no rank of this version"):
        decode_reply(fields)


# (order, its payload, its fields): the command's number (APPLY 0, ANSWER 1, DROP 2, FINISH 3,
# ANSWER_PULL 4, FAIL 5, LOST 6), the ranks it concerns, LOST's steps after its worker.
ORDERS = [
    (Order(Command.APPLY, (1, 2, 4)), [1, 2, 4], (0,)),
    (Order(Command.ANSWER, (2,)), [2], (1,)),
    (Order(Command.DROP, (3,)), [3], (2,)),
    (Order(Command.FINISH), [], (3,)),
    (Order(Command.ANSWER_PULL, (5,)), [5], (4,)),
    (Order(Command.FAIL, (1,)), [1], (5,)),
    (Order(Command.LOST, (3,), steps=9), [3, 9], (6,)),
]


@pytest.mark.parametrize("order, payload, fields", ORDERS, ids=[order.command.name for order, _, _ in ORDERS])
def test_an_order_travels_as_its_command_and_ranks(order, payload, fields):
    sent, sent_fields = encode_order(order)
    assert (sent.dtype, sent.tolist(), sent_fields) == (torch.int64, payload, fields)


@pytest.mark.parametrize("order", [order for order, _, _ in ORDERS], ids=[order.command.name for order, _, _ in ORDERS])
def test_an_order_comes_back_from_the_wire_as_it_was(order):
    payload, fields = encode_order(order)
    assert decode_order(payload.clone(), through_the_wire(fields)) == order


def test_a_command_no_rank_sends_is_refused():
    with pytest.raises(MismatchError, match="no rank of this version"):
        decode_order(torch.tensor([1]), (7,))


def test_each_kind_of_decision_has_the_command_of_its_effect():
    commands = {kind: order_of(Decision(kind, (1,))).command for kind in Kind}
    assert commands == {Kind.APPLY: Command.APPLY, Kind.ANSWER: Command.ANSWER, Kind.DROP: Command.DROP,
                        Kind.LOST: Command.LOST}


def test_a_policys_decisions_become_the_orders_the_servers_follow():
    # Sync mode, 3 workers with 1 backup: workers 1 and 2 make update 1, worker 3's gradient of
    # version 0 comes late and is dropped, then worker 1 dies after its one gradient.
    policy = Policy([1, 2, 3], per_update=2, backup_workers=1)
    decisions = policy.gradient(1, 0, 0) + policy.gradient(2, 0, 0) + policy.gradient(3, 0, 0) + policy.died(1)
    orders = [order_of(decision) for decision in decisions]
    assert orders == [Order(Command.APPLY, (1, 2)), Order(Command.ANSWER, (1,)), Order(Command.ANSWER, (2,)),
                      Order(Command.DROP, (3,)), Order(Command.ANSWER, (3,)), Order(Command.LOST, (1,), steps=1)]
    assert [encode_order(order)[0].tolist() for order in orders] == [[1, 2], [1], [2], [3], [3], [1, 1]]
