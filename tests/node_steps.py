"""The node window's all-reduce in host memory (mpidist._C.node_allreduce and its one-shot,
mpidist._C.node_one_shot; csrc/node_steps.h) run step by step, with a pause of the test's own
before each step that waits for a round: where a slow rank would be. `stepwise(pause)` replaces
both (monkeypatch them in: `for name, function in stepwise(pause).items(): monkeypatch.setattr(_C,
name, function)`); pause(step, last) is called before each such step, `last` being the call's
last step."""
from mpidist import _C

REAL = {"node_allreduce": _C.node_allreduce, "node_one_shot": _C.node_one_shot}


def stepwise(pause) -> dict:
    """The extension's name -> its step-by-step stand-in."""
    def step_by_step(real, rounds):
        def run(*arguments):
            *call, step, patience = arguments
            while 0 <= step < rounds:
                stopped = real(*call, step, patience, step + 1)
                if stopped == step:
                    return step  # still waiting in this step's round: the caller waits, then calls again
                step = stopped
                pause(step, rounds)
            return real(*call, step, patience)
        return run

    return {"node_allreduce": step_by_step(REAL["node_allreduce"], _C.node_allreduce_rounds(False)),
            "node_one_shot": step_by_step(REAL["node_one_shot"], _C.node_allreduce_rounds(True))}
