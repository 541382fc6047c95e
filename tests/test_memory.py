"""DataParallel keeps the CPU memory a step frees for the next step (mpidist/memory.py)."""
import json

from conftest import run_python

# A plain training loop, as users write it (torch's default zero_grad(set_to_none=True) frees the
# 12 MiB of gradients every step); prints, per rank, the median of the minor page faults per step
# after warm-up (the heap may still grow once in a while; what matters is every step).
SCRIPT = '''
import ctypes, json, os, resource, statistics, torch
import mpidist as md
from mpidist.memory import M_MMAP_THRESHOLD, keep_freed_memory

if os.environ.get("RETURN_FREED_MEMORY") == "1":
    # The control: every block of 128 KiB or more gets a mapping of its own, unmapped when freed
    # (glibc's starting setting, fixed: left alone glibc raises it as it sees such blocks freed,
    # and then whether memory goes back to the kernel depends on the allocations it has seen).
    assert ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1

torch.manual_seed(0)
torch.set_num_threads(1)
layers = [torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
          torch.nn.Linear(1024, 1024)]
model = md.DataParallel(torch.nn.Sequential(*layers))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 1024)

def step():
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()

for _ in range(3):
    step()
counts = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": statistics.median(counts), "kept": keep_freed_memory()}))
'''


def faults_per_step(ranks, env):
    result = run_python(SCRIPT, ranks=ranks, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == ranks, result.stdout
    return reports


def test_gradient_memory_is_reused_not_faulted_in_every_step():
    ranks = 2  # DataParallel under mpirun; the setting is per process, so one launch shows it
    # 12 MiB of gradients are 3,072 pages: where glibc gives them back to the kernel, every step
    # faults them in again (the control run shows the test would see it), with the setting none.
    default = faults_per_step(ranks, {})
    control = faults_per_step(ranks, {"MPIDIST_KEEP_FREED_MEMORY": "0", "RETURN_FREED_MEMORY": "1"})
    assert all(report["kept"] for report in default)
    assert not any(report["kept"] for report in control)
    assert all(report["faults"] < 32 for report in default), default
    assert all(report["faults"] > 1000 for report in control), control


def test_opting_out_leaves_malloc_alone(monkeypatch):
    from mpidist import memory
    monkeypatch.setattr(memory, "_kept", False)
    monkeypatch.setenv("MPIDIST_KEEP_FREED_MEMORY", "0")
    assert memory.keep_freed_memory() is False
