"""Training on uneven data with hvd.join(), as Horovod documents it, run on mpidist: the import is
`import mpidist.torch as hvd`. Each rank has a different number of batches (rank 0 the fewest,
the last rank all of its shard); a rank that runs out calls hvd.join() and takes part with zeros
in the others' gradient exchanges until every rank has joined. join() returns the rank that
joined last, whose parameters every rank then takes (the ranks that joined early kept the
parameters of their own last step). Data: the handwritten digits that ship with mpidist.

    mpirun -np 3 python examples/horovod/pytorch_join.py --epochs 2

Every rank prints its batch count, the rank that joined last and a checksum of its final
parameters, which is the same on every rank.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import mpidist
import mpidist.torch as hvd
from mpidist.data import HDF5Dataset, ensure_digits

parser = argparse.ArgumentParser(description='PyTorch uneven data with hvd.join (on the embedded digits)',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--batch-size', type=int, default=32, help='input batch size for training')
parser.add_argument('--test-batch-size', type=int, default=1000, help='input batch size for testing')
parser.add_argument('--epochs', type=int, default=5, help='number of epochs to train')
parser.add_argument('--lr', type=float, default=0.05, help='learning rate (scaled by the number of ranks)')
parser.add_argument('--momentum', type=float, default=0.9, help='SGD momentum')
parser.add_argument('--min-fraction', type=float, default=0.5,
                    help='the share of its data shard rank 0 trains on; the last rank trains on all of its '
                         'shard, the ranks between on shares in proportion')
parser.add_argument('--seed', type=int, default=42, help='random seed')
parser.add_argument('--log-interval', type=int, default=10, help='batches between log lines')
parser.add_argument('--no-cuda', action='store_true', default=False, help='disables CUDA training')
parser.add_argument('--data-dir', help='directory of the digits file digits.h5 (made there if missing)')


def uneven_share(indices, rank, size, min_fraction):
    """This rank's part of its shard: rank 0 keeps `min_fraction`, the last rank all of it."""
    fraction = 1.0 if size == 1 else min_fraction + (1.0 - min_fraction) * rank / (size - 1)
    return indices[:max(1, round(len(indices) * fraction))]


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def parameters_checksum(model):
    """A number that differs when any parameter differs (float64 sums, weighted by position)."""
    total = 0.0
    for index, tensor in enumerate(model.state_dict().values()):
        flat = tensor.detach().double().reshape(-1).cpu()
        total += (index + 1) * float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())
    return total


def main(args):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = 'cuda' if args.cuda else 'cpu'

    path = ensure_digits(os.path.join(args.data_dir, 'digits.h5') if args.data_dir else None,
                         comm=mpidist.init())
    train_set, test_set = HDF5Dataset(path, 'train'), HDF5Dataset(path, 'test')
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=size, rank=rank)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_set, num_replicas=size, rank=rank,
                                                                   shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    optimizer = optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    batches = 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        mine = uneven_share(list(train_sampler), rank, size, args.min_fraction)
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(train_set, mine), batch_size=args.batch_size)
        for batch_idx, (data, target) in enumerate(loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            batches += 1
            if batch_idx % args.log_interval == 0:
                print(f'Rank {rank} epoch {epoch} [{batch_idx * len(data)}/{len(mine)}]\tLoss: {loss.item():.6f}',
                      flush=True)
        # Horovod: this rank is out of data; wait, taking part in the others' exchanges, until
        # every rank is. The ranks that joined early kept the parameters (and momentum) of their
        # own last step: take the last joiner's.
        last = hvd.join()
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        hvd.broadcast_optimizer_state(optimizer, root_rank=last)

        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data.to(device))
                test_loss += F.cross_entropy(output, target.to(device), reduction='sum').item()
                correct += (output.argmax(dim=1).cpu() == target).sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), 'avg_loss')
        accuracy = metric_average(correct / len(test_sampler), 'avg_accuracy')
        if rank == 0:
            print(f'Epoch {epoch}: last to join: rank {last}; test set: average loss {test_loss:.4f}, '
                  f'accuracy {100 * accuracy:.2f}%', flush=True)

    print(f'Rank {rank}: {batches} batches, last to join: rank {last}, '
          f'parameters checksum {parameters_checksum(model):.10e}', flush=True)


if __name__ == '__main__':
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    main(args)
