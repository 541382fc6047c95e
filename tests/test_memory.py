"""DataParallel keeps the CPU memory a step frees for the next step (mpidist/memory.py)."""
import json
import sys

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
print(json.dumps({"rank": md.rank(), "faults": statistics.median(counts), "kept": keep_freed_memory()}))
'''


def faults_per_step():
    """Reports of rank 0, under the default settings, and rank 1, under the control's, of one
    DataParallel job: the settings are per process, so one launch (two programs: the second
    starts after the ":" that ends the first one's arguments) shows both."""
    control = ("MPIDIST_KEEP_FREED_MEMORY=0", "RETURN_FREED_MEMORY=1")
    result = run_python(SCRIPT, ranks=1, args=(":", "-np", "1", "env", *control, sys.executable, "-c", SCRIPT),
                        timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                     key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == [0, 1], result.stdout
    return reports


def test_gradient_memory_is_reused_not_faulted_in_every_step():
    # 12 MiB of gradients are 3,072 pages: where glibc gives them back to the kernel, every step
    # faults them in again (the control rank shows the test would see it), with the setting none.
    default, control = faults_per_step()
    assert default["kept"] and not control["kept"], (default, control)
    assert default["faults"] < 32, default
    assert control["faults"] > 1000, control


def test_opting_out_leaves_malloc_alone(monkeypatch):
    from mpidist import memory
    monkeypatch.setattr(memory, "_kept", False)
    monkeypatch.setenv("MPIDIST_KEEP_FREED_MEMORY", "0")
    assert memory.keep_freed_memory() is False
