"""Data-parallel training with one GPU per rank, or on the CPU where there is no GPU.

The same script runs on a laptop and in a SLURM GPU job (docs/gpu-training.md):

    python examples/gpu_training.py                       # one process
    mpirun -np 2 python examples/gpu_training.py          # two ranks
    srun --mpi=pmix --ntasks-per-node=4 --gpus-per-task=1 python examples/gpu_training.py

It learns a synthetic 10-class problem (labels from a fixed random linear "teacher"). Each
global batch is split evenly over the ranks and DataParallel averages their gradients, so any
rank count trains as one process does on the whole batch. Rank 0 prints the loss and the test
accuracy after each epoch.
"""
import argparse

import torch

import mpidist as md
from mpidist.launch import gpu_for_local_rank

FEATURES, CLASSES = 32, 10


def choose_device() -> torch.device:
    """This rank's GPU, as mpidist.launch picks it from the launcher's variables, or the CPU where
    there is none."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # One GPU visible per rank (srun --gpus-per-task=1) makes this device 0; with all of a
    # node's GPUs visible (mpirun, --gpus-per-node) each rank on the node takes its own.
    device = torch.device("cuda", gpu_for_local_rank(device_count=torch.cuda.device_count()))
    # Before any CUDA work: otherwise every rank's context, and mpidist's staging buffers, would
    # land on GPU 0.
    torch.cuda.set_device(device)
    return device


def synthetic_problem(samples: int, seed: int):
    """(inputs, labels): the same on every rank, whatever the device."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    inputs = torch.randn(samples, FEATURES, generator=generator)
    return inputs, (inputs @ teacher).argmax(dim=1)


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()

    md.init()
    rank, size = md.rank(), md.size()
    if args.batch_size % size:
        raise SystemExit(f"--batch-size {args.batch_size} does not split evenly over {size} ranks")
    device = choose_device()
    share = args.batch_size // size

    train_x, train_y = (t.to(device) for t in synthetic_problem(args.samples, seed=0))
    test_x, test_y = (t.to(device) for t in synthetic_problem(1024, seed=1))
    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))
    model = md.DataParallel(network.to(device))   # rank 0's weights on every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(epoch)).to(device)
        epoch_loss = torch.zeros(1, device=device)
        for start in range(0, args.samples - args.batch_size + 1, args.batch_size):
            rows = order[start + rank * share:start + (rank + 1) * share]   # this rank's part of the batch
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(train_x[rows]), train_y[rows])
            loss.backward()   # the gradients are averaged over the ranks here
            optimizer.step()
            epoch_loss += loss.detach()
        md.allreduce(epoch_loss, op="avg")   # a GPU tensor, like any other
        with torch.no_grad():
            accuracy = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
        steps = args.samples // args.batch_size
        if rank == 0:
            print(f"epoch {epoch}: loss {epoch_loss.item() / steps:.4f}, test accuracy {accuracy:.4f} "
                  f"({size} ranks on {device.type})", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
