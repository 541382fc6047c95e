"""The parameter server's update policy (mpidist/parallel/ps/policy.py) in one process, without
MPI: simulated workers push gradients in orders, with stragglers and deaths, that hypothesis
draws, and every rule docs/parameter-server.md states is checked on the decisions: a sync update
holds one gradient of every worker still training, computed on the current weights; an
n-softsync update at most workers // n, an async one one; no worker starts a step more than
max_staleness steps ahead of the slowest; backup workers drop exactly the gradients computed on
weights an update already replaced; every gradient is applied, dropped or lost with its dead
worker exactly once, and a worker is answered only after its own gradient is taken. The
recorded updates, replayed in float64 from their records alone, give the weights the simulated
server reached."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mpidist.parallel.ps.policy import Kind, Policy, gradients_per_update

LR, FEATURES = 0.05, 3


def gradient(weights, worker, step):
    """A worker's gradient at `weights`: a function of the weights, so that a gradient computed
    on other weights than recorded changes the replay."""
    generator = np.random.default_rng(100 * worker + step)
    return generator.standard_normal((FEATURES, FEATURES)) @ weights + generator.standard_normal(FEATURES)


def replay(start, updates):
    """The weights after `updates`, from their records alone, in float64: each gradient
    recomputed on the weights of the version its worker had."""
    versions = {updates[0].version - 1 if updates else 0: start.copy()}
    weights = start.copy()
    for update in updates:
        mean = np.mean([gradient(versions[seen], worker, step) for worker, step, seen in update.gradients], axis=0)
        weights = weights - LR * update.lr_scale * mean
        versions[update.version] = weights.copy()
    return weights


@st.composite
def setups(draw):
    workers = draw(st.integers(1, 5))
    mode = draw(st.sampled_from(["sync", "async", "softsync"]))
    softsync = draw(st.integers(1, workers + 1)) if mode == "softsync" else None
    backup = draw(st.integers(0, workers - 1)) if mode == "sync" else 0
    staleness = draw(st.one_of(st.none(), st.integers(0, 3)))
    steps = draw(st.lists(st.integers(0, 5), min_size=workers, max_size=workers))
    # A plain sync parameter server ends when a worker dies (survival.py): deaths elsewhere only.
    deaths = draw(st.integers(0, workers)) if mode != "sync" or backup else 0
    return dict(workers=list(range(1, workers + 1)), mode=mode, softsync=softsync, backup=backup,
                staleness=staleness, steps=steps, deaths=deaths, staleness_lr=draw(st.booleans()),
                version=draw(st.integers(0, 3)))


class Simulation:
    """Workers that compute on the weights they were answered with and push when drawn; the
    server's weights stepped with each APPLY as it is decided. Each decision is checked here."""

    def __init__(self, setup):
        self.setup = setup
        workers = setup["workers"]
        self.per_update = gradients_per_update(setup["mode"], len(workers), setup["softsync"], setup["backup"])
        self.policy = Policy(workers, self.per_update, setup["staleness"], setup["staleness_lr"], setup["backup"],
                             setup["version"])
        self.version = setup["version"]
        self.start = np.linspace(-1.0, 1.0, FEATURES)
        self.weights = {self.version: self.start.copy()}
        self.computing = {w: self.version for w in workers}  # worker -> the version of its weights
        self.pushed = dict.fromkeys(workers, 0)
        self.active = set(workers)
        self.pending = {}  # worker -> its gradient not yet taken (worker, step, version)
        self.updates, self.dropped, self.lost = [], [], []

    def push(self, worker):
        version = self.computing.pop(worker)
        record = (worker, self.pushed[worker], version)
        self.pushed[worker] += 1
        self.pending[worker] = record
        self.late = bool(self.setup["backup"]) and version < self.version
        self.take(self.policy.gradient(*record))
        assert (record in self.dropped) == self.late, f"late {self.late}, yet dropped {record in self.dropped}"

    def close(self, worker):
        del self.computing[worker]
        self.active.discard(worker)
        self.take(self.policy.done(worker))

    def die(self, worker):
        self.computing.pop(worker, None)
        self.active.discard(worker)
        self.lost.append(self.pending.pop(worker, None))
        self.take(self.policy.died(worker))

    def take(self, decisions):
        carry_out = {Kind.APPLY: self.apply, Kind.ANSWER: self.answer, Kind.DROP: self.drop, Kind.LOST: self.check_lost}
        for decision in decisions:
            carry_out[decision.kind](decision)

    def apply(self, decision):
        update = decision.update
        taken = [self.pending.pop(worker) for worker in decision.workers]
        assert list(update.gradients) == taken, "an update holds other gradients than its workers pushed"
        assert list(decision.workers) == sorted(decision.workers)
        assert update.version == self.version + 1
        assert update.staleness == np.mean([self.version - seen for _, _, seen in taken])
        assert update.lr_scale == (1 / max(1.0, update.staleness) if self.setup["staleness_lr"] else 1.0)
        if self.setup["mode"] == "sync":
            assert all(seen == self.version for _, _, seen in taken), "a sync update takes a stale gradient"
            if not self.setup["backup"]:
                assert set(decision.workers) == self.active, "a sync update misses a worker still training"
        # Fewer than its share only when every worker still training waits (nobody could bring more).
        assert len(taken) == self.per_update or (len(taken) < self.per_update and not self.active & set(self.computing))
        mean = np.mean([gradient(self.weights[seen], worker, step) for worker, step, seen in taken], axis=0)
        self.version = update.version
        self.weights[self.version] = self.weights[self.version - 1] - LR * update.lr_scale * mean
        self.updates.append(update)

    def answer(self, decision):
        (worker,) = decision.workers
        assert worker in self.active and worker not in self.computing and worker not in self.pending, \
            f"worker {worker} answered before its gradient was taken"
        if self.setup["staleness"] is not None:
            assert self.pushed[worker] - min(self.pushed[w] for w in self.active) <= self.setup["staleness"]
        self.computing[worker] = self.version

    def drop(self, decision):
        (worker,) = decision.workers
        assert decision.dropped == self.pending.pop(worker)
        self.dropped.append(decision.dropped)

    def check_lost(self, decision):
        assert decision.steps == self.pushed[decision.workers[0]]


@settings(max_examples=300, deadline=None)
@given(setup=setups(), data=st.data())
def test_the_policy_keeps_every_rule_it_states(setup, data):
    simulation = Simulation(setup)
    deaths = setup["deaths"]
    while simulation.active:
        ready = sorted(simulation.computing)
        assert ready, "every worker still training waits and no update comes"  # the policy never stalls
        if deaths and data.draw(st.booleans(), label="a worker dies"):  # computing, or waiting for its weights
            deaths -= 1
            simulation.die(data.draw(st.sampled_from(sorted(simulation.active)), label="the worker that dies"))
            continue
        worker = data.draw(st.sampled_from(ready), label="the next worker to finish computing")
        if simulation.pushed[worker] == setup["steps"][worker - 1]:
            simulation.close(worker)
        else:
            simulation.push(worker)
    assert simulation.policy.finished and not simulation.pending, "a gradient left untaken"
    taken = [g for u in simulation.updates for g in u.gradients] + simulation.dropped + \
        [g for g in simulation.lost if g is not None]
    pushed = [(w, step) for w in setup["workers"] for step in range(simulation.pushed[w])]
    assert sorted((w, step) for w, step, _ in taken) == pushed, "a gradient taken twice or never"
    expected = simulation.weights[simulation.version]
    assert np.array_equal(replay(simulation.start, simulation.updates), expected)
