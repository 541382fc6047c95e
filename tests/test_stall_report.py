"""The stall report (runtime/stall.py) on every route a training script waits for its peers by:
DataParallel's gradient buckets, hvd.DistributedOptimizer and hvd's ops, the torch.distributed
backend "mpidist" and the checkpoint functions. A rank that waits past MPIDIST_STALL_WARNING
names the rank that has not arrived, long before MPIDIST_TIMEOUT.

Each check launches mpirun itself: the report is printed to the job's output, which a test
running inside the ranks cannot read."""
import re
import textwrap

from stall_output import launch, report_before_deadline

# Rank 1 comes 2 s late to each route's exchange; the others wait for it, report it once
# (from rank 0, the lowest rank waiting), and the exchange then completes with the right result.
LATE_RANK = textwrap.dedent("""
    import os, sys, tempfile, time
    import torch
    import torch.distributed as dist
    import mpidist as md
    import mpidist.torch as hvd
    from mpidist.checkpoint import load_checkpoint, save_checkpoint
    md.init()
    hvd.init()
    dist.init_process_group("mpidist")
    rank, size = md.rank(), md.size()

    def arrive(route):
        md.barrier()
        if rank == 0:
            print(f"route: {route}", file=sys.stderr, flush=True)
        if rank == 1:
            time.sleep(2)

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(3, 1, bias=False)

    data = md.DataParallel(model())
    arrive("DataParallel")
    data(torch.full((1, 3), float(rank))).sum().backward()
    assert torch.allclose(data.module.weight.grad, torch.full((1, 3), (size - 1) / 2)), data.module.weight.grad

    horovod = model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(horovod.parameters(), lr=1.0),
                                         named_parameters=horovod.named_parameters())
    arrive("DistributedOptimizer")
    horovod(torch.full((1, 3), float(rank))).sum().backward()
    optimizer.step()
    assert torch.allclose(horovod.weight, model().weight - (size - 1) / 2), horovod.weight

    arrive("hvd.allreduce")
    assert hvd.allreduce(torch.ones(4), op=hvd.Sum).eq(size).all()

    arrive("dist.all_reduce")
    total = torch.ones(4)
    dist.all_reduce(total)
    assert total.eq(size).all()

    path = os.path.join(tempfile.gettempdir(), f"stall-report-{os.getppid()}.h5")
    arrive("save_checkpoint")
    save_checkpoint(path, horovod, comm=md.world())
    arrive("load_checkpoint")
    load_checkpoint(path, model(), comm=md.world())
    if rank == 0:
        os.remove(path)
    dist.destroy_process_group()
""")


def test_every_route_reports_the_rank_that_comes_late():
    result, output = launch(LATE_RANK, deadline_s=60, timeout=180)
    assert result.returncode == 0, output
    routes = re.split(r"route: ", result.stderr)[1:]
    assert [route.split("\n")[0] for route in routes] == [
        "DataParallel", "DistributedOptimizer", "hvd.allreduce", "dist.all_reduce", "save_checkpoint",
        "load_checkpoint"], output
    waits = {"DataParallel": "the all-reduce of gradient bucket 0", "DistributedOptimizer": "the all-reduce of "
             "gradient bucket 0", "hvd.allreduce": "the hvd operation '<unnamed operation", "dist.all_reduce": "the allreduce "
             "call check", "save_checkpoint": "the gather of save_checkpoint",
             "load_checkpoint": "the agreement on loading"}
    for route in routes:
        name = route.split("\n")[0]
        assert route.count("mpidist: stall:") == 1, (name, output)
        assert f"rank 0 has waited 1 s in {waits[name]}" in route, (name, output)
        assert re.search(r"ranks \[1\] have not arrived:\n  rank 1: last called .*, which returned", route), \
            (name, output)


def test_ranks_training_on_while_one_saves_a_checkpoint_alone_each_report_the_other():
    # Rank 0 saves with comm= (a collective) while ranks 1 and 2 go on into the next gradient
    # exchange: each side's report says where the other waits, before the deadline ends the job.
    code = textwrap.dedent("""
        import os, tempfile
        import torch
        import mpidist as md
        from mpidist.checkpoint import save_checkpoint
        md.init()
        model = md.DataParallel(torch.nn.Linear(3, 1))
        if md.rank() == 0:
            save_checkpoint(os.path.join(tempfile.gettempdir(), f"stall-alone-{os.getppid()}.h5"), model,
                            comm=md.world())
        model(torch.ones(1, 3)).sum().backward()
    """)
    result, output = launch(code, deadline_s=4)
    assert result.returncode != 0, output
    report_before_deadline(output, "rank 1 has waited 1 s in the all-reduce of gradient bucket 0 "
                           "(MPIDIST_STALL_WARNING); ranks [0] have not arrived:\n"
                           "  rank 0: waits in the gather of save_checkpoint", "DeadlineError")
    report_before_deadline(output, "rank 0 has waited 1 s in the gather of save_checkpoint", "DeadlineError")
