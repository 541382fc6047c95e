"""Optimizer state sharding: PyTorch's ZeroRedundancyOptimizer on mpidist's collectives (ZeRO
stage 1, Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020).

Every rank holds all parameters, but each parameter's optimizer state (momentum, Adam's moments)
lives on one rank only, its owner: the optimizer's memory and the time of its step are divided
among the ranks (by whole parameters, so as evenly as the parameters' sizes allow). The
gradients must already be the same on every rank (DataParallel, or DistributedOptimizer's
exchange): each rank steps the parameters it owns, then every owner broadcasts its updated
parameters to the others.
"""
from __future__ import annotations

import torch

from ..comm import broadcast_json, init
from ..errors import InvalidArgumentError, MpidistError, NotOfferedError
from ..runtime import wire
from .flat import tensors_by_kind
from .model_state import broadcast_end_to_end


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class, **defaults) with
    `comm=` (an mpidist Communicator; default the world) in place of `process_group=`.

    Parameters are assigned to ranks as torch assigns them: each parameter group's parameters,
    largest first, each to the rank owning the fewest elements so far. `self.param_groups` holds
    every parameter and the hyperparameters (a learning-rate scheduler works on it as on any
    optimizer); `self.optim` is this rank's optimizer over the parameters it owns.
    """

    def __init__(self, params, optimizer_class, comm=None, process_group=None, parameters_as_bucket_view=False,
                 overlap_with_ddp=False, **defaults):
        if process_group is not None:
            raise InvalidArgumentError("process_group= is torch.distributed's; pass comm= (an mpidist Communicator)")
        if overlap_with_ddp:
            raise NotOfferedError("overlap_with_ddp=True is not offered: step() runs after backward")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise InvalidArgumentError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        super().__init__(params, defaults)
        self.comm = comm if comm is not None else init()
        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = parameters_as_bucket_view  # accepted; parameters keep their storage
        self._consolidated = None
        self._assign_owners()
        self.optim = optimizer_class([self._my_share(group) for group in self.param_groups], **defaults)
        # The optimizer's own defaults (Adam's eps, ...) complete the groups, as a plain one's.
        self.defaults = {**self.optim.defaults, **self.defaults}
        for group in self.param_groups:
            for key, value in self.optim.defaults.items():
                group.setdefault(key, value)

    def _assign_owners(self) -> None:
        self._owners = self._partition()
        # Each owner's parameters of each dtype and device: one broadcast each after a step.
        self._shares = [tensors_by_kind(self.owned_by(owner)) for owner in range(self.comm.size)]

    def _my_share(self, group) -> dict:
        """`group` with only the parameters this rank owns (none, possibly: the local optimizer
        keeps a group for every group, so that the two lists stay in step)."""
        return {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in group["params"] if self._owners[id(p)] == self.comm.rank]}

    def _partition(self) -> dict:
        """id(parameter) -> owning rank (torch's greedy assignment; the same on every rank)."""
        owners, load = {}, [0] * self.comm.size
        for group in self.param_groups:
            for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
                rank = load.index(min(load))
                owners[id(param)] = rank
                load[rank] += param.numel()
        return owners

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def owned_by(self, rank: int) -> list:
        """The parameters whose optimizer state `rank` holds, in parameter-group order."""
        return [p for p in self._all_params() if self._owners[id(p)] == rank]

    @torch.no_grad()
    def step(self, closure=None):
        # Hyperparameters set on this object (a scheduler's learning rate) apply to the shard.
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})
        loss = self.optim.step(closure)
        self._consolidated = None
        self._broadcast_parameters()
        return loss

    def _broadcast_parameters(self) -> None:
        """Every owner sends its updated parameters to the others: one broadcast per owner and
        dtype, of its parameters laid end to end."""
        for owner, kinds in enumerate(self._shares):
            for members in kinds:
                broadcast_end_to_end(self.comm, [p.data for p in members], root=owner)

    def add_param_group(self, param_group):
        """As torch's (fine-tuning a layer that was frozen, say): call it on every rank with the
        same group. The assignment goes group by group, so the earlier groups keep their owners
        and their state; the new group's parameters go to the ranks owning the fewest elements."""
        super().add_param_group(param_group)
        if getattr(self, "optim", None) is None:
            return  # the constructor's own calls: it assigns every group once they are all in
        self._assign_owners()
        self.optim.add_param_group(self._my_share(self.param_groups[-1]))
        self._consolidated = None

    # ---- checkpoints -------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's share of the optimizer state on rank `to` (collective), so that
        state_dict() there returns the state of a plain optimizer over all the parameters. The
        state travels as tensors and JSON, never pickled."""
        if not (isinstance(to, int) and 0 <= to < self.comm.size):
            raise InvalidArgumentError(f"consolidate_state_dict(to={to!r}): not a rank of this communicator "
                                       f"(size {self.comm.size})")
        index = {id(p): k for k, p in enumerate(self._all_params())}
        local = self.optim.state_dict()
        local_ids = [id(p) for group in self.optim.param_groups for p in group["params"]]
        state = {}
        for owner in range(self.comm.size):
            entries = {index[local_ids[k]]: value for k, value in local["state"].items()} \
                if owner == self.comm.rank else None
            received = broadcast_state(self.comm, entries, owner)
            if self.comm.rank == to:
                state.update(received)
        if self.comm.rank != to:
            self._consolidated = None
            return
        groups = []
        for group in self.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({**settings, "params": [index[id(p)] for p in group["params"]]})
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}

    def state_dict(self):
        if self._consolidated is None:
            raise MpidistError(f"rank {self.comm.rank}: call consolidate_state_dict(to=...) on every rank first "
                               "and state_dict() on the rank it named (as with torch's ZeroRedundancyOptimizer)")
        return self._consolidated

    def load_state_dict(self, state_dict):
        """Load the state of a plain optimizer over all the parameters (what state_dict() returns):
        every rank keeps its own share. Call it on every rank with the same dictionary."""
        params = self._all_params()
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise InvalidArgumentError("the state dict's parameter groups do not match this optimizer's")
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        order = [k for g in groups for k in g["params"]]  # saved index of each parameter, in order
        local_index = {id(p): k for k, p in enumerate(p for g in self.optim.param_groups for p in g["params"])}
        state = {}
        for param, saved_index in zip(params, order):
            if id(param) in local_index and saved_index in state_dict["state"]:
                state[local_index[id(param)]] = state_dict["state"][saved_index]
        local_groups, start = [], 0
        for group, local in zip(self.param_groups, self.optim.param_groups):
            count = len(local["params"])
            local_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": list(range(start, start + count))})
            start += count
        self.optim.load_state_dict({"state": state, "param_groups": local_groups})
        self._consolidated = None


def broadcast_state(comm, entries, root: int) -> dict:
    """`root`'s optimizer state entries ({parameter index: {name: tensor or number}}) on every
    rank: the layout and the numbers as JSON, then each tensor."""
    layout = None
    if comm.rank == root:
        layout = {str(k): {name: ([list(v.shape), wire.name_of(v.dtype)] if isinstance(v, torch.Tensor)
                                  else ["value", v]) for name, v in values.items()}
                  for k, values in entries.items()}
    layout = broadcast_json(comm, layout, root, "consolidate_state_dict")
    result = {}
    for key, values in layout.items():
        entry = {}
        for name, (shape, detail) in values.items():
            if shape == "value":
                entry[name] = detail
                continue
            tensor = entries[int(key)][name].detach().clone().contiguous() if comm.rank == root \
                else torch.empty(shape, dtype=wire.torch_dtype(detail))
            comm.broadcast(tensor.reshape(-1) if tensor.dim() else tensor.reshape(1), root=root)
            entry[name] = tensor
        result[int(key)] = entry
    return result
