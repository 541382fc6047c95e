"""Horovod's PyTorch synthetic benchmark, run on mpidist: the import is
`import mpidist.torch as hvd`. Training throughput of a model on fixed random images.

    mpirun -np 2 python examples/horovod/pytorch_synthetic_benchmark.py --model convnet --no-cuda

--model names a torchvision model (torchvision must be installed; default resnet50, as Horovod's)
or `convnet`, a small convolutional network defined here that needs nothing else. As in
Horovod, batch normalization is hvd.SyncBatchNorm. --image-size and --num-classes (Horovod's
fixed 224 and 1000) make the images smaller for a quick run; --blocks deepens the convnet (more
gradient tensors, as a real network has). --data-parallel trains with mpidist's own
md.DataParallel instead of hvd.DistributedOptimizer, to compare the two
(benchmarks/horovod_training.py).
"""
import argparse
import timeit

import numpy as np
import torch.backends.cudnn as cudnn
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import mpidist as md
import mpidist.torch as hvd

# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')

parser.add_argument('--model', type=str, default='resnet50',
                    help='model to benchmark: a torchvision model, or convnet (built in)')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size')
parser.add_argument('--image-size', type=int, default=224,
                    help='height and width of the synthetic images')
parser.add_argument('--num-classes', type=int, default=1000,
                    help='number of classes of the synthetic labels')
parser.add_argument('--blocks', type=int, default=3,
                    help='convolution blocks of --model convnet (16, 32, then 64 channels)')
parser.add_argument('--data-parallel', action='store_true', default=False,
                    help="train with mpidist's md.DataParallel instead of hvd.DistributedOptimizer")

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='number of benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')

parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction')


def convnet(num_classes, norm_layer, blocks=3):
    """A small image classifier: `blocks` convolutions with batch normalization, the first three
    strided (16, 32, 64 channels), the others keeping 64 channels."""
    layers = []
    channels = [3, 16, 32] + [64] * (blocks - 2)
    for index, (inputs, outputs) in enumerate(zip(channels[:-1], channels[1:])):
        layers += [nn.Conv2d(inputs, outputs, kernel_size=3, stride=2 if index < 3 else 1, padding=1, bias=False),
                   norm_layer(outputs), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def build_model(args):
    if args.model == 'convnet':
        return convnet(args.num_classes, norm_layer=hvd.SyncBatchNorm, blocks=args.blocks)
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f'--model {args.model} needs torchvision (pip install torchvision); '
                         '--model convnet needs nothing else') from None
    return getattr(models, args.model)(num_classes=args.num_classes, norm_layer=hvd.SyncBatchNorm)


args = parser.parse_args()
if args.blocks < 3:
    parser.error(f'--blocks {args.blocks}: the convnet has at least 3 blocks')
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Set up standard model.
model = build_model(args)

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

if args.cuda:
    # Move model to GPU.
    model.cuda()
    # If using GPU Adasum allreduce, scale learning rate by local_size.
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()

optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

if args.data_parallel:
    # mpidist's own data parallel: its buckets all-reduce the gradients during backward.
    model = md.DataParallel(model)
else:
    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % args.num_classes
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '', flush=True)


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))

# Warm-up
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
