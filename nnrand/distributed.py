"""Data-parallel training over ``torchrun`` ranks, and gradients that do not depend on the world size.

``nnrand.train`` runs in one of three ways:

- one process (no ``torchrun``, or ``--nproc_per_node 1``): nothing here is used but :func:`tree_sum`;
- plain data parallel: each of W ranks trains on its B/W images of every global batch of B, and
  ``DistributedDataParallel`` all-reduces the gradients (NCCL on GPUs, gloo on CPUs). With deterministic
  kernels inside every rank this repeats bitwise at a fixed W and topology, but another W changes the
  bits: other local batch shapes (so other kernels), BatchNorm statistics over other images, another
  all-reduce order;
- ``--world-invariant`` (:class:`InvariantStep`): the same bits on any power-of-two W that divides the
  number of micro-batches. Its pieces:

  1. every image's crop and flip are keyed by its dataset index (``data.augment_indexed``), not drawn
     from a rank's generator;
  2. the global batch is cut into ``B / m`` micro-batches of ``m`` images (``--micro-batch``, default
     B/4), micro-batch ``j`` always holds images ``j*m .. j*m+m-1`` of the global batch and runs on rank
     ``j // (B/m/W)``; every micro-batch has the same shape on every W, so every rank runs the same
     kernels and algorithms;
  3. BatchNorm normalises with the statistics of each micro-batch (ghost BatchNorm: the virtual batch
     size is ``m``); the running statistics move once per step, towards the mean over micro-batches of
     each micro-batch's mean and unbiased variance;
  4. the loss of a micro-batch is its summed cross-entropy divided by B (the global batch), so each
     micro-batch's gradient is its share of the global mean;
  5. micro-batch gradients, BatchNorm statistics and metrics are added in one fixed binary tree over
     micro-batch indices (:func:`tree_sum`: split in halves, left + right). With W a power of two that
     divides the number of micro-batches, each rank's micro-batches form whole subtrees, so a rank sums
     its own subtree, one ``all_gather`` brings every rank the W subtree sums, and every rank finishes the
     same tree: the same additions in the same order whatever W is. (IEEE addition is commutative, so
     ``a + b`` and ``b + a`` have the same bits; the order that matters is the grouping, fixed here.)
  6. dropout and other random layers draw from a generator seeded per (step, micro-batch).

With ``--cuda-graph`` one micro-batch's forward, backward and the copies of its gradient, statistics and
metrics are captured once in a CUDA graph and replayed for every micro-batch (the host reseeds before
each replay, as before each eager micro-batch); the all_gather, the top of the tree and the optimizer
stay eager. The replay runs the eager kernels in the eager order, so the bits are the same as eager on
every world size (tests/test_distributed_gpu.py: ResNet-18 on 1, 2 and 4 GPUs; tests/test_invariant_graph_gpu.py:
dropout and a parameter without a gradient, one GPU).

Collectives time out after ``--dist-timeout`` seconds, and a rank whose peer exits sees its next
collective fail: :class:`RankFailure` names the rank and the step, and the process exits non-zero.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


class RankFailure(RuntimeError):
    """A collective failed: another rank exited, or did not answer within the timeout."""


class InvariantModelError(ValueError):
    """A model whose state --world-invariant cannot keep the same on every world size: running statistics
    of another kind than BatchNorm's, or a BatchNorm module that runs other than once per forward."""


class LaunchError(ValueError):
    """The torchrun environment is malformed."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    timeout_s: float = 300.0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env(env=None) -> World:
    """The rank and world size ``torchrun`` put in the environment (RANK, WORLD_SIZE, LOCAL_RANK);
    one process of one without them."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return World()
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise LaunchError(f"WORLD_SIZE/RANK/LOCAL_RANK must be integers, got {env.get('WORLD_SIZE')!r}/"
                          f"{env.get('RANK')!r}/{env.get('LOCAL_RANK')!r}") from None
    if size < 1 or not 0 <= rank < size or local < 0:
        raise LaunchError(f"bad torchrun environment: RANK={rank} WORLD_SIZE={size} LOCAL_RANK={local}")
    return World(rank=rank, size=size, local_rank=local)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# --------------------------------------------------------------------------------------------------
# Process group


class Group:
    """The process group of a run: the default group (NCCL on CUDA, gloo on CPU) for tensors, and a
    gloo group for host-side agreement (interrupts, barriers), which also notices a dead peer at once."""

    def __init__(self, world: World, device: torch.device):
        self.world = world
        self.device = device
        self.step = 0          # for error messages
        self.control = None
        if world.distributed:
            timeout = datetime.timedelta(seconds=world.timeout_s)
            backend = "nccl" if device.type == "cuda" else "gloo"
            with self.guard("process group start-up"):
                dist.init_process_group(backend, timeout=timeout, rank=world.rank, world_size=world.size)
                self.control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None

    def close(self, wait: bool = True) -> None:
        """Tear the process group down. ``wait`` (a run that ended normally): first a barrier on the gloo
        group, so that no rank destroys its part while another is still using it (a rank torn down early,
        the TCP store's host among them, could abort with SIGABRT in gloo's threads: "terminate called
        without an active exception"); a run that failed does not wait for peers that may be gone."""
        if self.world.distributed and dist.is_initialized():
            try:
                if wait:
                    self.barrier()
            finally:
                dist.destroy_process_group()

    @contextmanager
    def guard(self, what: str, *, only_collectives: bool = False):
        """Turn a collective's failure into a :class:`RankFailure` that says who and where. With
        ``only_collectives`` (around code that also does other things, such as a DDP step), other
        errors pass through unchanged."""
        try:
            yield
        except RuntimeError as e:  # gloo and NCCL failures (DistBackendError is one)
            if isinstance(e, RankFailure) or not self.world.distributed:
                raise
            if only_collectives and not _is_collective_error(e):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RankFailure(f"rank {self.world.rank} of {self.world.size}: {what} failed at step {self.step} "
                              f"(a rank exited or did not answer within {self.world.timeout_s:g} s): {first}") from e

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any (host-side; no device sync)."""
        return self.any_each([flag])[0]

    def any_each(self, flags: list[bool]) -> list[bool]:
        """Element by element, true on every rank where true on any (one host-side all_reduce)."""
        if not self.world.distributed:
            return [bool(f) for f in flags]
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
        with self.guard("agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return [bool(v) for v in t.tolist()]

    def barrier(self) -> None:
        if self.world.distributed:
            with self.guard("barrier"):  # gloo: names the ranks that did not arrive
                dist.monitored_barrier(group=self.control, timeout=datetime.timedelta(seconds=self.world.timeout_s))

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t``, in rank order."""
        if not self.world.distributed:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world.size)]
        with self.guard("all_gather"):
            dist.all_gather(out, t.contiguous())
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world.distributed:
            with self.guard("all_reduce"):
                dist.all_reduce(t)
        return t

    def gather_objects(self, obj) -> list:
        if not self.world.distributed:
            return [obj]
        out = [None] * self.world.size
        with self.guard("all_gather_object"):
            dist.all_gather_object(out, obj, group=self.control)
        return out


def _is_collective_error(e: BaseException) -> bool:
    dist_backend_error = getattr(dist, "DistBackendError", ())
    text = str(e)
    return isinstance(e, dist_backend_error) or any(k in text for k in ("gloo", "NCCL", "ProcessGroup",
                                                                            "Connection closed", "Connection reset"))


# --------------------------------------------------------------------------------------------------
# World-size invariant step


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` added in a fixed binary tree: the sum of the first ``len // 2`` plus the sum of the rest.

    For a list of ``W * k`` parts with W a power of two, the top ``log2 W`` levels split it exactly into
    the W runs of k parts, so ``tree_sum([tree_sum(run) for run in runs])`` has the same bits."""
    if not parts:
        raise ValueError("tree_sum: nothing to add")
    if len(parts) == 1:
        return parts[0]
    half = len(parts) // 2
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


def check_invariant_layout(batch: int, micro: int, world: int) -> int:
    """Micro-batches per rank for a world-invariant step; raises ValueError naming what does not fit."""
    if micro < 1 or batch % micro:
        raise ValueError(f"--micro-batch {micro} must divide --batch-size {batch}")
    n_micro = batch // micro
    if not is_power_of_two(world) or n_micro % world:
        raise ValueError(f"--world-invariant: the world size ({world}) must be a power of two that divides the "
                         f"{n_micro} micro-batches of --batch-size {batch} / --micro-batch {micro}")
    return n_micro // world


def batchnorms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and m.track_running_stats and m.running_mean is not None]


@contextmanager
def warm_up_stream(device: torch.device, stream: torch.cuda.Stream | None = None):
    """A side stream (``stream``, or a new one) for the lazy work before a CUDA-graph capture (kernel
    compilation, cuDNN plans): it waits for the current stream, random draws inside do not move the run's
    generators, and the current stream waits for it afterwards. Yields the stream."""
    side = stream or torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.random.fork_rng(devices=[device]), torch.cuda.stream(side):
        yield side
    torch.cuda.current_stream().wait_stream(side)


@dataclass
class _Captured:
    """One captured micro-batch: its graph, static inputs, the outputs every replay rewrites, and which
    parameters it gives a gradient (agreed over the ranks at the capture)."""

    graph: "torch.cuda.CUDAGraph"
    x: torch.Tensor
    y: torch.Tensor
    flat: torch.Tensor
    stat: torch.Tensor | None
    metric: torch.Tensor
    used: list[bool]


class InvariantStep:
    """Forward and backward of this rank's micro-batches, then the world's gradient sum in a fixed tree
    (module docstring, 2-6). After a call every parameter's ``.grad`` holds the gradient of the global
    batch's mean loss (None for a parameter no micro-batch gave a gradient, as after a plain backward),
    and the BatchNorm running statistics have moved one step: the same bits on every rank and on every
    world size the layout allows.

    Cost, on top of the micro-batches' forward and backward: one copy of the flat gradient per micro-
    batch (kept until the step ends: k x the parameter bytes), k - 1 + W - 1 vector additions, one
    ``all_gather`` of W x (parameters + BatchNorm statistics) floats, one copy back into ``.grad``, and a
    host-side all_reduce of one flag per parameter (which ones got a gradient).

    ``graph=True`` (CUDA): the first micro-batch is captured (after two warm-up passes of a copy of the
    model on a side stream, for lazy initialisation) and every micro-batch replays the capture; which
    parameters get a gradient is settled once, at the capture. Python work per micro-batch drops to the
    input copies, the reseed and one replay."""

    def __init__(self, model: torch.nn.Module, group: Group, *, batch: int, micro: int, seed: int,
                 graph: bool = False):
        lazy = [n for n, m in model.named_modules() if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin)
                and m.has_uninitialized_params()]
        if lazy:
            raise InvariantModelError(f"--world-invariant: {lazy[0]} is a lazy module not yet initialised; run one "
                                      "forward before building the step")
        self.model = model
        self.group = group
        self.batch = batch
        self.micro = micro
        self.local = check_invariant_layout(batch, micro, group.world.size)
        self.n_micro = batch // micro
        self.seed = seed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sizes = [p.numel() for p in self.params]
        self.bns = batchnorms(model)
        self.stat_sizes = [2 * m.running_mean.numel() for m in self.bns]
        norm_base = torch.nn.modules.batchnorm._NormBase
        others = [(n, m) for n, m in model.named_modules() if isinstance(m, norm_base)
                  and not isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        if others:
            name, m = others[0]
            raise InvariantModelError(
                f"--world-invariant: {name or 'the model'} ({type(m).__name__}) keeps running statistics, which "
                "only BatchNorm's are combined across micro-batches and ranks; they would differ between world "
                "sizes (build it with track_running_stats=False, or train without --world-invariant)")
        self.bn_calls_checked = False
        if graph and group.device.type != "cuda":
            raise ValueError(f"InvariantStep: graph=True captures CUDA work; the device is {group.device}")
        self.graph = graph
        self.captured: _Captured | None = None

    def first_micro(self) -> int:
        """Global index of this rank's first micro-batch."""
        return self.group.world.rank * self.local

    def _seed_random_layers(self, seed: int) -> None:
        torch.random.default_generator.manual_seed(seed)
        if self.group.device.type == "cuda":
            torch.cuda.manual_seed(seed)   # this rank's device only

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in self.params])

    def _micro_batch(self, x: torch.Tensor, y: torch.Tensor, stat_tensors: list[torch.Tensor]):
        """Forward and backward of one micro-batch with its share of the global mean loss: (flat gradient,
        BatchNorm statistics or None, [summed loss, correct], which parameters got a gradient)."""
        logits = self.model(x)
        ce = F.cross_entropy(logits, y, reduction="sum")
        (ce / self.batch).backward()
        used = [p.grad is not None for p in self.params]
        flat = self._flat_grad()
        stat = torch.cat([t.reshape(-1).float() for t in stat_tensors]) if self.bns else None
        with torch.no_grad():
            metric = torch.stack([ce.detach().double(), (logits.argmax(1) == y).sum().double()])
        return flat, stat, metric, used

    def _capture(self, x: torch.Tensor, y: torch.Tensor, stat_tensors: list[torch.Tensor]) -> _Captured:
        """Capture one micro-batch (BatchNorm momentum is 1 here, as in every micro-batch). Lazy work
        (kernel compilation, cuDNN plans) runs first on a copy of the model on a side stream, so the
        model's weights and statistics change only on replay; its random draws do not move the run's
        generators."""
        import copy

        with warm_up_stream(x.device):
            warm = copy.deepcopy(self.model)
            for _ in range(2):
                (F.cross_entropy(warm(x), y, reduction="sum") / self.batch).backward()
            del warm
        xs, ys = x.clone(), y.clone()
        for p in self.params:
            p.grad = None    # the capture allocates the gradients it writes on every replay
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            flat, stat, metric, used = self._micro_batch(xs, ys, stat_tensors)
        return _Captured(g, xs, ys, flat, stat, metric, self.group.any_each(used))

    def _replay(self, x: torch.Tensor, y: torch.Tensor, stat_tensors: list[torch.Tensor]):
        if self.captured is None:
            self.captured = self._capture(x, y, stat_tensors)
        c = self.captured
        c.x.copy_(x)
        c.y.copy_(y)
        c.graph.replay()
        # the capture's outputs are overwritten by the next replay: keep copies for the tree
        return c.flat.clone(), None if c.stat is None else c.stat.clone(), c.metric.clone(), c.used

    def check_batchnorm_calls(self, x: torch.Tensor) -> None:
        """Every tracked BatchNorm must run exactly once per forward: its running statistics are taken as
        the micro-batch's own (momentum 1) and its batch count corrected by one per micro-batch, which a
        module run twice (shared) or never would break. Counted once, on a copy of the model (forward
        only, the run's random generators untouched)."""
        import copy

        if self.bn_calls_checked or not self.bns:
            return
        warm = copy.deepcopy(self.model)
        names = {id(m): n for n, m in self.model.named_modules()}
        copies = dict(zip((id(m) for m in batchnorms(warm)), self.bns))
        calls = {k: 0 for k in copies}
        hooks = [m.register_forward_pre_hook(lambda mod, _: calls.__setitem__(id(mod), calls[id(mod)] + 1))
                 for m in batchnorms(warm)]
        devices = [x.device] if x.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                warm(x)
        finally:
            for h in hooks:
                h.remove()
        frozen = [names[id(m)] for m in self.bns if not m.training]
        if frozen:   # its statistics stay, but the step would still correct a batch count it never moved
            raise InvariantModelError(f"--world-invariant: BatchNorm {frozen[0]} is in eval mode while training; "
                                      "only BatchNorms in training mode are combined per micro-batch (put the "
                                      "model in training mode, or build the frozen ones with "
                                      "track_running_stats=False)")
        bad = [(names[id(copies[k])], n) for k, n in calls.items() if n != 1]
        if bad:
            name, n = bad[0]
            raise InvariantModelError(f"--world-invariant: BatchNorm {name} runs {n} times per forward (expected "
                                      "once: its running statistics are combined per micro-batch)")
        self.bn_calls_checked = True

    def __call__(self, batches, step: int) -> torch.Tensor:
        """``batches``: this rank's (x, y) micro-batches in order. Returns the global batch's
        [summed loss, correct predictions] (float64, on the device)."""
        from nnrand import noise

        batches = list(batches)
        if batches:
            self.check_batchnorm_calls(batches[0][0])

        stat_tensors = [t for m in self.bns for t in (m.running_mean, m.running_var)]
        saved = torch.cat([t.reshape(-1).float() for t in stat_tensors]) if self.bns else None
        momenta = [m.momentum for m in self.bns]
        for m in self.bns:
            m.momentum = 1.0     # the running statistics become this micro-batch's, exactly
        grads, stats, metrics = [], [], []
        used = [False] * len(self.params)   # whether a parameter got a gradient in any micro-batch
        done = False
        try:
            for jj, (x, y) in enumerate(batches):
                self._seed_random_layers(noise.derive(self.seed, step, self.first_micro() + jj))
                if self.graph:
                    flat, stat, metric, got = self._replay(x, y, stat_tensors)
                else:
                    for p in self.params:
                        p.grad = None
                    flat, stat, metric, got = self._micro_batch(x, y, stat_tensors)
                used = [u or g for u, g in zip(used, got)]
                grads.append(flat)
                if stat is not None:
                    stats.append(stat)
                metrics.append(metric)
            done = True
        finally:
            for m, momentum in zip(self.bns, momenta):
                m.momentum = momentum
            if self.bns:
                # each forward counted one batch; the step counts one
                torch._foreach_sub_([m.num_batches_tracked for m in self.bns], len(stats) - 1 if done else len(stats))
                if not done:
                    self._write_stats(stat_tensors, saved)
        grad = tree_sum(grads)
        stat = tree_sum(stats) if stats else None
        metric = tree_sum(metrics)
        if self.group.world.distributed:
            grad, stat, metric = self._combine(grad, stat, metric)
        # captured: the flags were agreed at the capture (a replay cannot change which parameters get one)
        self._write_grads(grad, used if self.graph else self.group.any_each(used))
        if stat is not None:
            self._update_running(stat_tensors, saved, stat)
        return metric

    def _combine(self, grad, stat, metric):
        """One all_gather of every rank's subtree sums, then the top of the tree on every rank."""
        pieces = [grad] + ([stat] if stat is not None else []) + [metric.view(torch.float32)]
        packed = torch.cat(pieces)
        parts = self.group.all_gather(packed)
        n_g, n_s = grad.numel(), 0 if stat is None else stat.numel()
        grad = tree_sum([p[:n_g] for p in parts])
        stat = None if stat is None else tree_sum([p[n_g:n_g + n_s] for p in parts])
        metric = tree_sum([p[n_g + n_s:].clone().view(torch.float64) for p in parts])  # clone: 8-byte aligned
        return grad, stat, metric

    def _write_grads(self, flat: torch.Tensor, used: list[bool]) -> None:
        """Each parameter's slice of the summed gradient; None for one that no micro-batch on any rank gave
        a gradient (``used``): the optimizer then leaves it alone, as after a plain backward."""
        for p, g, u in zip(self.params, flat.split(self.sizes), used):
            p.grad = g.view(p.shape).to(p.dtype) if u else None

    @torch.no_grad()
    def _update_running(self, targets: list[torch.Tensor], saved: torch.Tensor, total: torch.Tensor) -> None:
        """running <- (1 - f) * running + f * (mean over micro-batches of their statistics); f is the
        module's momentum, or 1 / batches tracked for a cumulative average (momentum None)."""
        mean_of = total / self.n_micro
        momenta = {m.momentum for m in self.bns}
        if None not in momenta and len(momenta) == 1:       # the usual case: one fused update
            f = momenta.pop()
            self._write_stats(targets, torch.add(saved * (1.0 - f), mean_of, alpha=f))
            return
        new = []
        for m, old, s in zip(self.bns, saved.split(self.stat_sizes), mean_of.split(self.stat_sizes)):
            f = m.momentum if m.momentum is not None else 1.0 / float(m.num_batches_tracked)
            new.append(torch.add(old * (1.0 - f), s, alpha=f))
        self._write_stats(targets, torch.cat(new))

    @staticmethod
    def _write_stats(targets: list[torch.Tensor], flat: torch.Tensor) -> None:
        with torch.no_grad():
            parts = [p.view_as(t).to(t.dtype) for p, t in zip(flat.split([t.numel() for t in targets]), targets)]
            torch._foreach_copy_(targets, parts)
