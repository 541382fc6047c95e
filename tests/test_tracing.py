"""Communication events (runtime/tracing.py): every collective and every gradient bucket's
all-reduce is an event in torch.profiler's trace while a profiler records, and a span on the
timeline that MPIDIST_TIMELINE starts at md.init(), outside the hvd namespace."""
import json
import textwrap

from conftest import run_python

# MPIDIST_CHECK=0: small all-reduces may take the fast path, which must not hide them from the
# profiler. The model's four parameters make four gradient buckets (bucket_mb is tiny).
SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    import mpidist as md
    md.init()
    model = md.DataParallel(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), bucket_mb=1e-5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        small = np.ones(4, dtype=np.float32)
        md.allreduce(small)
        assert (small == md.size()).all()
        md.broadcast(np.ones(8), root=0)
        md.allgather(np.ones(2))
        md.reduce_scatter(np.ones(4))
        md.barrier()
        model(torch.ones(5, 4)).sum().backward()
    model(torch.ones(5, 4)).sum().backward()  # not profiled: on the timeline only
    if md.rank() == 0:
        print("EVENTS " + json.dumps(sorted({e.name for e in profiler.events() if e.name.startswith("mpidist.")})))
""")


def test_collectives_and_gradient_buckets_are_in_the_profilers_trace_and_on_the_timeline(tmp_path):
    timeline = tmp_path / "timeline.json"
    result = run_python(SCRIPT, ranks=2, env={"MPIDIST_CHECK": "0", "MPIDIST_TIMELINE": str(timeline)})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    events = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("EVENTS "))[7:])
    buckets = [f"mpidist.gradient_bucket.{index}" for index in range(4)]
    assert events == ["mpidist.allgather", "mpidist.allreduce", "mpidist.barrier", "mpidist.broadcast", *buckets,
                      "mpidist.reduce_scatter"], output
    trace = json.load(open(timeline))  # rank 0 writes it, finished at exit
    rows = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    spans = {}
    for event in trace:
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
            spans.setdefault(rows[event["pid"]], []).append(event["name"])
    # DataParallel's construction broadcasts the parameters (mpidist.broadcast) and checks the
    # ranks' models (mpidist.allgather) before the calls above.
    assert spans["mpidist.allreduce"] == ["ALLREDUCE"], spans
    assert spans["mpidist.reduce_scatter"] == ["REDUCESCATTER"], spans
    assert spans["mpidist.barrier"] == ["BARRIER"], spans
    assert spans["mpidist.broadcast"][-1] == "BROADCAST" and spans["mpidist.allgather"][-1] == "ALLGATHER", spans
    assert [spans[f"gradient bucket {index}"] for index in range(4)] == [["ALLREDUCE"] * 2] * 4, spans
