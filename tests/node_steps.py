"""The node window's all-reduce in host memory (mpidist._C.node_allreduce, csrc/node_steps.h)
run step by step, with a pause of the test's own before each step that waits for a round: where a
slow rank would be. `stepwise(pause)` replaces mpidist._C.node_allreduce (monkeypatch it in);
pause(step, last) is called before each such step, `last` being the call's last step."""
from mpidist import _C

REAL = _C.node_allreduce


def stepwise(pause):
    def node_allreduce(*arguments):
        *call, step, patience = arguments
        rounds = _C.node_allreduce_rounds(call[-2])  # the call's arguments end with one_shot, signature
        while 0 <= step < rounds:
            stopped = REAL(*call, step, patience, step + 1)
            if stopped == step:
                return step  # still waiting in this step's round: the caller waits, then calls again
            step = stopped
            pause(step, rounds)
        return REAL(*call, step, patience)

    return node_allreduce
