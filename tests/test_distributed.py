"""Several processes: the fixed summation tree, index-keyed augmentation, launch errors, and torchrun
runs on the CPU (gloo) whose final weights and logits are bitwise identical on 1, 2 and 4 processes
with --world-invariant and differ without it; a killed rank makes the others fail within the timeout."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nnrand import data, distributed, runio, train
from tests.helpers import bitwise_equal

REPO = Path(__file__).resolve().parent.parent

# 8 steps of 32 images on the CPU model: a few seconds per process.
RUN = ["--device", "cpu", "--model", "small", "--kernel", "tree", "--epochs", "1", "--n-train", "256",
       "--n-test", "64", "--batch-size", "32", "--no-progress", "--no-report", "--dist-timeout", "60"]


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(nproc: int, out: Path, *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "nnrand.train", *RUN, "--out", str(out), "--name", "run", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)


def result_of(out: Path) -> dict:
    return runio.read_json(runio.member_dir(out, "run", 0) / "result.json")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(n: int, argv: list[str], port: int) -> list[subprocess.Popen]:
    """The n workers torchrun would start, started by hand so that each one's exit can be watched."""
    return [subprocess.Popen([sys.executable, "-m", "nnrand.train", *argv], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=n, MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=port, OMP_NUM_THREADS=1))
            for r in range(n)]


# --------------------------------------------------------------------------------------------------
# The fixed tree


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("per_rank", [1, 3, 4])
def test_tree_sum_of_rank_subtrees_is_the_whole_tree(world, per_rank):
    g = torch.Generator().manual_seed(world * 10 + per_rank)
    # magnitudes spread over 2^-20 .. 2^20 so that the grouping of the additions shows in the bits
    parts = [torch.randn(257, generator=g) * 2.0 ** torch.randint(-20, 21, (257,), generator=g)
             for _ in range(world * per_rank)]
    whole = distributed.tree_sum(parts)
    runs = [distributed.tree_sum(parts[r * per_rank:(r + 1) * per_rank]) for r in range(world)]
    assert bitwise_equal(distributed.tree_sum(runs), whole)


def test_tree_sum_grouping_matters():
    """Negative control: the same parts added left to right give other bits, so the test above can fail."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(1024, generator=g) * 2.0 ** torch.randint(-20, 21, (1024,), generator=g) for _ in range(8)]
    seq = parts[0]
    for p in parts[1:]:
        seq = seq + p
    assert not torch.equal(seq, distributed.tree_sum(parts))
    with pytest.raises(ValueError, match="nothing to add"):
        distributed.tree_sum([])


@pytest.mark.parametrize("batch,micro,world,message", [
    (32, 5, 1, "--micro-batch 5 must divide --batch-size 32"),
    (32, 8, 3, r"world size \(3\) must be a power of two"),
    (32, 8, 8, r"divides the 4 micro-batches"),
])
def test_invariant_layout_errors(batch, micro, world, message):
    with pytest.raises(ValueError, match=message):
        distributed.check_invariant_layout(batch, micro, world)
    assert distributed.check_invariant_layout(32, 8, 4) == 1
    assert distributed.check_invariant_layout(32, 4, 2) == 4


def test_world_from_env():
    assert distributed.world_from_env({}) == distributed.World()
    w = distributed.world_from_env({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"})
    assert (w.rank, w.size, w.local_rank, w.distributed, w.is_main) == (2, 4, 2, True, False)
    for env in ({"WORLD_SIZE": "two"}, {"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(distributed.LaunchError):
            distributed.world_from_env(env)


# --------------------------------------------------------------------------------------------------
# The step in one process

U = 2.0 ** -24   # float32 unit roundoff


@pytest.mark.parametrize("wait, calls", [(True, ["barrier", "destroy"]), (False, ["destroy"])])
def test_close_waits_for_every_rank_before_tearing_down(monkeypatch, wait, calls):
    """A run that ended normally meets the other ranks at a barrier before destroying its process group
    (a rank torn down while a peer still used the group could abort in gloo's threads); a failed run
    does not wait for peers that may be gone; the group is destroyed even if the barrier fails."""
    seen = []
    group = distributed.Group(distributed.World(), torch.device("cpu"))
    group.world = distributed.World(rank=0, size=2)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "monitored_barrier", lambda **kw: seen.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: seen.append("destroy"))
    group.close(wait=wait)
    assert seen == calls

    def dead(**kw):
        raise RuntimeError("Rank 1 failed to pass monitoredBarrier")

    seen.clear()
    monkeypatch.setattr(torch.distributed, "monitored_barrier", dead)
    with pytest.raises(distributed.RankFailure):
        group.close()
    assert seen == ["destroy"]


def test_invariant_step_gradient_is_the_global_mean_loss_gradient():
    """4 micro-batches of 8: each one's summed loss / 32, added in the tree, is the gradient of the
    mean loss over all 32 images."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(16, 5)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 5, (32,), generator=g)
    group = distributed.Group(distributed.World(), torch.device("cpu"))
    step = distributed.InvariantStep(model, group, batch=32, micro=8, seed=0)
    metric = step([(x[j:j + 8], y[j:j + 8]) for j in range(0, 32, 8)], step=0)
    ref = torch.nn.Linear(16, 5).double()
    ref.load_state_dict(model.state_dict())
    per_sample = []
    for i in range(32):
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]).backward()
        per_sample.append(ref.weight.grad.clone())
    exact = torch.stack(per_sample).mean(0)
    # each float32 term carries a few roundings (softmax, product, / 32) and each lands in a sum of 32:
    # |error| <= 64 u * sum |term| / 32, generously above the ~(8 + log2 32) u of the arithmetic
    bound = 64 * U * torch.stack(per_sample).abs().sum(0) / 32
    assert ((model.weight.grad.double() - exact).abs() <= bound).all()
    loss = torch.nn.functional.cross_entropy(model(x).double(), y, reduction="sum")
    assert abs(metric[0].item() - loss.item()) <= 64 * U * loss.item()
    assert metric[1].item() == (model(x).argmax(1) == y).sum().item()


def test_invariant_step_running_statistics_move_once_per_step():
    """One micro-batch: the running statistics take one momentum step towards its batch statistics,
    as BatchNorm's own update does; the batch counter moves by one per step whatever the micro-batches."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 5, 5, generator=g) * 3 + 1
    y = torch.randint(0, 2, (16,), generator=g)

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=0.25),
                                   torch.nn.Flatten(), torch.nn.Linear(36, 2))

    group = distributed.Group(distributed.World(), torch.device("cpu"))
    model, ref = net(), net()
    distributed.InvariantStep(model, group, batch=16, micro=16, seed=0)([(x, y)], step=0)
    ref(x)   # BatchNorm's own update, momentum 0.25
    bn, rbn = model[1], ref[1]
    for a, b in ((bn.running_mean, rbn.running_mean), (bn.running_var, rbn.running_var)):
        # both are 0.75 * old + 0.25 * stat from the same stat: a few roundings of |terms|
        assert ((a - b).abs() <= 4 * U * (0.75 * b.abs() + b.abs())).all()
    assert int(bn.num_batches_tracked) == 1
    model4 = net()
    distributed.InvariantStep(model4, group, batch=16, micro=4, seed=0)([(x[j:j + 4], y[j:j + 4]) for j in
                                                                        range(0, 16, 4)], step=0)
    assert int(model4[1].num_batches_tracked) == 1 and model4[1].momentum == 0.25
    assert not torch.equal(model4[1].running_var, bn.running_var)   # ghost BatchNorm: other statistics


class _Gated(torch.nn.Module):
    """A linear layer, plus ``extra`` only for inputs whose first feature is positive (data-dependent use),
    and ``idle`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 3)
        self.extra = torch.nn.Parameter(torch.ones(3))
        self.idle = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        out = self.lin(x)
        return out + self.extra if bool(x[0, 0] > 0) else out


def _gated_batches():
    """Four micro-batches of 2; only the last one switches ``extra`` on."""
    g = torch.Generator().manual_seed(3)
    x = -torch.rand(8, 4, generator=g)
    x[6, 0] = 1.0
    return [(x[j:j + 2], torch.tensor([0, 1])) for j in range(0, 8, 2)]


def _gated_step(group):
    model = _Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    step = distributed.InvariantStep(model, group, batch=8, micro=2, seed=0)
    mine = _gated_batches()[step.first_micro():step.first_micro() + step.local]
    step(mine, step=0)
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_invariant_step_leaves_parameters_without_a_gradient_alone():
    """A parameter no micro-batch uses keeps grad None, so weight decay and momentum do not move it (as
    after a plain backward); one that a single micro-batch uses gets that micro-batch's gradient."""
    grads, after = _gated_step(distributed.Group(distributed.World(), torch.device("cpu")))
    assert grads["idle"] is None and bitwise_equal(after["idle"], torch.ones(3))
    assert grads["extra"] is not None and not torch.equal(after["extra"], torch.ones(3))
    assert all(grads[n] is not None for n in ("lin.weight", "lin.bias"))


def _rank(rank: int, size: int, port: int, out: str, steps) -> None:
    """One spawned process of ``size``: ``steps(group)``'s result saved as ``out/rank<rank>.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = distributed.Group(distributed.World(rank=rank, size=size, timeout_s=60), torch.device("cpu"))
    finished = False
    try:
        torch.save(steps(group), f"{out}/rank{rank}.pt")
        finished = True
    finally:
        group.close(wait=finished)


def test_invariant_step_agrees_on_used_parameters_across_ranks(tmp_path):
    """On 2 processes only rank 1's micro-batches use ``extra``: both ranks still give it the summed
    gradient, and every parameter and gradient has one process's bits on both."""
    import torch.multiprocessing as mp

    one_grads, one_after = _gated_step(distributed.Group(distributed.World(), torch.device("cpu")))
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path), _gated_step), nprocs=2, join=True)
    for rank in range(2):
        grads, after = torch.load(tmp_path / f"rank{rank}.pt")
        assert grads["idle"] is None and grads["extra"] is not None
        for n in one_grads:
            assert (grads[n] is None) == (one_grads[n] is None)
            if grads[n] is not None:
                assert bitwise_equal(grads[n], one_grads[n]), (rank, n)
            assert bitwise_equal(after[n], one_after[n]), (rank, n)


class _Dropped(torch.nn.Module):
    """Dropout between a BatchNorm'd layer and the head: its masks must be drawn per micro-batch, the same
    on any number of processes."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16)
        self.drop, self.head = torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.bn(self.lin(x)))))


def _dropped_steps(group, steps: int = 3, seed: int = 11):
    torch.manual_seed(4)
    model = _Dropped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = distributed.InvariantStep(model, group, batch=8, micro=2, seed=seed)
    g = torch.Generator().manual_seed(5)
    for k in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        micro = [(x[j:j + 2], y[j:j + 2]) for j in range(0, 8, 2)]
        step(micro[step.first_micro():step.first_micro() + step.local], step=k)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_invariant_step_with_dropout_and_batchnorm_is_world_invariant(tmp_path):
    """Three steps of a model with dropout and BatchNorm on 1 and on 2 processes: the weights and running
    statistics of every rank have the one-process run's bits. The dropout is live (a negative control:
    another seed gives other weights), so equal bits are not equal because nothing was dropped."""
    import torch.multiprocessing as mp

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as every rank: BLAS blocks products by thread count
    try:
        one = _dropped_steps(distributed.Group(distributed.World(), torch.device("cpu")))
        other = _dropped_steps(distributed.Group(distributed.World(), torch.device("cpu")), seed=12)
    finally:
        torch.set_num_threads(threads)
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path), _dropped_steps), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(bitwise_equal(got[k], one[k]) for k in one), rank
    assert not torch.equal(other["lin.weight"], one["lin.weight"])


# --------------------------------------------------------------------------------------------------
# Augmentation keyed by the image's index


def test_indexed_augmentation_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (16, 3, 32, 32), generator=g, dtype=torch.uint8)
    idx = torch.randperm(1000, generator=g)[:16]
    whole = data.augment_indexed(x, idx, seed=5, epoch=2)
    # the same images in another grouping and order get the same crops and flips
    perm = torch.randperm(16, generator=g)
    halves = [data.augment_indexed(x[perm[s:s + 8]], idx[perm[s:s + 8]], seed=5, epoch=2) for s in (0, 8)]
    assert bitwise_equal(torch.cat(halves), whole[perm])
    oy, ox, fl = data.sample_draws(torch.arange(4096), seed=5, epoch=2)
    assert oy.min() == 0 and oy.max() == 8 and ox.min() == 0 and ox.max() == 8
    assert 0.45 < fl.float().mean() < 0.55     # 4096 fair coins: 0.05 is 6.4 standard deviations
    other = data.sample_draws(torch.arange(4096), seed=5, epoch=3)
    assert (oy != other[0]).float().mean() > 0.8   # a new epoch redraws (chance of a repeat: 1/9)
    with pytest.raises(ValueError, match="index must have shape"):
        data.augment_indexed(x, idx[:3], seed=5, epoch=2)


def test_indexed_channel_orders_are_keyed_permutations():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (16, 3, 8, 8), generator=g, dtype=torch.uint8)
    idx = torch.randperm(1000, generator=g)[:16]
    whole = data.augment_indexed(x, idx, seed=5, epoch=2, shuffle_channels=True)
    plain = data.augment_indexed(x, idx, seed=5, epoch=2)
    order = data.channel_orders(idx, 5, 2, 3)
    assert bitwise_equal(whole, torch.stack([plain[i, order[i]] for i in range(16)]))
    halves = [data.augment_indexed(x[s:s + 8], idx[s:s + 8], seed=5, epoch=2, shuffle_channels=True) for s in (0, 8)]
    assert bitwise_equal(torch.cat(halves), whole)   # keyed by the index, not by the batch
    orders = data.channel_orders(torch.arange(6000), 5, 2, 3)
    assert bitwise_equal(orders.sort(dim=1).values, torch.arange(3).expand(6000, 3))
    # the 6 orders about equally often: each count is Binomial(6000, 1/6), mean 1000, SD 28.9; +-150 is 5.2 SD
    counts = torch.bincount(orders[:, 0] * 3 + orders[:, 1], minlength=9)
    assert all(abs(int(counts[a * 3 + b]) - 1000) <= 150 for a in range(3) for b in range(3) if a != b)
    assert (orders != data.channel_orders(torch.arange(6000), 5, 3, 3)).any(dim=1).double().mean() > 0.6


def test_index_draws_are_splitmix64_of_the_index():
    """The signed-int64 torch arithmetic equals splitmix64 written in NumPy uint64."""
    idx = np.arange(0, 5_000_000, 997, dtype=np.uint64)
    key = np.uint64(data.noise_key(5, 2))
    with np.errstate(over="ignore"):
        z = key ^ (idx * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h = z ^ (z >> np.uint64(31))
    oy, ox, fl = data.sample_draws(torch.from_numpy(idx.astype(np.int64)), seed=5, epoch=2)
    assert np.array_equal(oy.numpy(), ((h & np.uint64(0xFFFF)) % np.uint64(9)).astype(np.int64))
    assert np.array_equal(ox.numpy(), (((h >> np.uint64(16)) & np.uint64(0xFFFF)) % np.uint64(9)).astype(np.int64))
    assert np.array_equal(fl.numpy(), ((h >> np.uint64(32)) & np.uint64(1)).astype(bool))


# --------------------------------------------------------------------------------------------------
# Launch errors, before anything trains


@pytest.mark.parametrize("env,argv,message", [
    ({"WORLD_SIZE": "3", "RANK": "1"}, ["--batch-size", "32"], "not divisible by the world size 3"),
    ({"WORLD_SIZE": "3", "RANK": "0"}, ["--world-invariant"], "must be a power of two"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--world-invariant", "--micro-batch", "32"], "divides the 1 micro-batches"),
    ({}, ["--micro-batch", "8"], "--micro-batch applies to --world-invariant"),
    ({}, ["--world-invariant", "--micro-batch", "1"], "--micro-batch must be >= 2"),
    ({}, ["--dist-timeout", "0"], "--dist-timeout must be"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, [], "bad torchrun environment"),
])
def test_bad_launch_fails_clearly_before_training(monkeypatch, capsys, tmp_path, env, argv, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    base = [a for a in RUN if a != "--dist-timeout" and a != "60"]
    with pytest.raises(SystemExit) as e:
        train.cli([*base, "--out", str(tmp_path), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "RANK" in env and "bad torchrun" not in message:
        assert f"rank {env['RANK']} of {env['WORLD_SIZE']}" in err
    assert not list(tmp_path.iterdir())      # nothing was written


def test_cuda_graph_with_ranks_is_accepted_with_and_without_world_invariant(monkeypatch):
    """A DDP step may be captured (the capture holds its all-reduces), and so may a --world-invariant
    micro-batch (one capture replayed per micro-batch); the GPU tests compare both with eager. On the CPU
    the invariant step refuses a graph, naming the device."""
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    train._resolve_world(train.Config(cuda_graph=True, batch_size=64), torch.device("cuda"))
    cfg = train.Config(cuda_graph=True, world_invariant=True, batch_size=64)
    train._resolve_world(cfg, torch.device("cuda"))
    assert cfg.micro_batch == 16
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    for batch, micro in ((4, 2), (6, 3), (2, 2)):   # the most micro-batches of 2 images or more, up to 4
        cfg = train.Config(world_invariant=True, batch_size=batch)
        train._resolve_world(cfg, torch.device("cpu"))
        assert cfg.micro_batch == micro, batch
    group = distributed.Group(distributed.World(), torch.device("cpu"))
    with pytest.raises(ValueError, match="graph=True captures CUDA work; the device is cpu"):
        distributed.InvariantStep(torch.nn.Linear(2, 2), group, batch=4, micro=2, seed=0, graph=True)


# --------------------------------------------------------------------------------------------------
# torchrun on the CPU


def test_world_invariant_bits_on_1_2_and_4_processes(tmp_path):
    runs = {}
    for n in (1, 2, 4):
        r = torchrun(n, tmp_path / f"inv{n}", "--world-invariant", "--micro-batch", "8")
        assert r.returncode == 0, r.stderr[-3000:]
        runs[n] = result_of(tmp_path / f"inv{n}")
        assert runs[n]["world_size"] == n and runs[n]["world_invariant"]
        logs = sorted(p.name for p in (tmp_path / f"inv{n}" / "run" / "logs").iterdir())
        assert logs == [f"rank{r}.log" for r in range(n)]
    for n in (2, 4):
        assert runs[n]["final_checksum"] == runs[1]["final_checksum"], n
        assert runs[n]["logits_hash"] == runs[1]["logits_hash"], n
        assert runs[n]["train_loss"] == runs[1]["train_loss"], n
        assert runs[n]["coverage"] == runs[1]["coverage"] and runs[1]["coverage"], n   # every rank's calls counted
        a = runio.member_dir(tmp_path / "inv1", "run", 0)
        b = runio.member_dir(tmp_path / f"inv{n}", "run", 0)
        assert (a / "checksums.csv").read_bytes() == (b / "checksums.csv").read_bytes()


def test_world_invariant_with_one_plan_of_per_shape_choices(tmp_path):
    """--kernel fastest-deterministic under --world-invariant: one process times the candidates on
    micro-batches of 8 and records its choices; two processes following that plan (every rank meets only
    micro-batches of 8) give the planning run's bits."""
    fast = ["--kernel", "fastest-deterministic", "--world-invariant", "--micro-batch", "8"]
    r = torchrun(1, tmp_path / "plan", *fast)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = runio.member_dir(tmp_path / "plan", "run", 0) / "config.json"
    choices = runio.read_json(plan)["autotune"]["choices"]
    # shapes of micro-batches, the training step's forward convs among them (evaluation is not tuned)
    assert choices and all(" x=8x" in key for key in choices), list(choices)[:3]
    assert any(k.startswith("conv_fwd ") for k in choices), list(choices)
    r = torchrun(2, tmp_path / "two", *fast, "--autotune-plan", str(plan))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = result_of(tmp_path / "plan"), result_of(tmp_path / "two")
    assert b["world_size"] == 2 and (a["final_checksum"], a["logits_hash"]) == (b["final_checksum"], b["logits_hash"])


def test_plain_data_parallel_bits_depend_on_the_world_size(tmp_path):
    """Negative control: the same global batch without --world-invariant gives other weights on 1, 2
    and 4 processes (other local batch shapes, BatchNorm statistics, all-reduce order)."""
    sums = {}
    for n in (1, 2, 4):
        r = torchrun(n, tmp_path / f"ddp{n}")
        assert r.returncode == 0, r.stderr[-3000:]
        sums[n] = result_of(tmp_path / f"ddp{n}")["final_checksum"]
    assert len(set(sums.values())) == 3, sums


def test_plain_data_parallel_runs_past_its_first_epoch(tmp_path):
    """The checkpoint at an epoch's end holds no augmentation state on any rank; the next epoch must
    start from its own seed, not from a list of Nones."""
    r = torchrun(2, tmp_path / "ddp", "--epochs", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert result_of(tmp_path / "ddp")["steps"] == 2 * 256 // 32


def test_world_invariant_run_resumes_on_fewer_processes(tmp_path):
    """Interrupted on 2 processes, finished on 1: the bits of an uninterrupted run."""
    argv = [*RUN, "--world-invariant", "--micro-batch", "8", "--epochs", "2", "--name", "run"]
    straight = train.main(train.config_from_args(train.parser().parse_args([*argv, "--out", str(tmp_path / "a")])))
    script = ("import sys; from nnrand import train; "
              "cfg = train.config_from_args(train.parser().parse_args(sys.argv[1:])); cfg.interrupt_at_step = 11; "
              "train.main(cfg)")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, *argv, "--out", str(tmp_path / "b")], cwd=REPO,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode != 0 and "interrupted at step 11" in err, err[-3000:]
    d = runio.member_dir(tmp_path / "b", "run", 0)
    assert (d / "checkpoint.pt").exists() and not (d / "result.json").exists()
    resumed = train.main(train.config_from_args(train.parser().parse_args([*argv, "--out", str(tmp_path / "b")])))
    a, b = straight["members"][0], resumed["members"][0]
    assert (a["final_checksum"], a["logits_hash"]) == (b["final_checksum"], b["logits_hash"])
    assert runio.read_json(d / "config.json")["resumed_from"]["step"] == 11


def test_a_killed_rank_makes_the_others_fail_within_the_timeout(tmp_path):
    timeout = 20
    argv = [*RUN, "--epochs", "100", "--out", str(tmp_path), "--name", "run", "--dist-timeout", str(timeout)]
    procs = spawn_ranks(2, argv, free_port())
    log = tmp_path / "run" / "logs" / "rank1.log"
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and "starting" in log.read_text()):
            assert time.monotonic() < deadline, "rank 1 did not start training"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.2)
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGKILL)
        # a rank 0 that hangs past its --dist-timeout (and a margin for its exit) fails the test here
        _, err = procs[0].communicate(timeout=timeout + 30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode == 4, err[-3000:]
    assert "rank 0 of 2" in err and "failed at step" in err
    assert "stopped: RankFailure" in (tmp_path / "run" / "logs" / "rank0.log").read_text()


def test_invariant_step_refuses_state_it_cannot_make_world_invariant():
    """Running statistics other than BatchNorm's (InstanceNorm tracking them) are refused when the step is
    built; a BatchNorm run twice per forward (shared) at the first step, before anything changed."""
    group = distributed.Group(distributed.World(), torch.device("cpu"))
    inorm = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.InstanceNorm2d(4, track_running_stats=True))
    with pytest.raises(distributed.InvariantModelError, match=r"1 \(InstanceNorm2d\) keeps running statistics"):
        distributed.InvariantStep(inorm, group, batch=8, micro=2, seed=0)
    distributed.InvariantStep(torch.nn.Sequential(torch.nn.InstanceNorm2d(4)), group, batch=8, micro=2, seed=0)

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(self.bn(self.conv(self.bn(x))).mean((2, 3)))

    torch.manual_seed(0)
    model = Shared()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = distributed.InvariantStep(model, group, batch=4, micro=2, seed=0)
    x, y = torch.randn(4, 3, 5, 5), torch.tensor([0, 1, 0, 1])
    with pytest.raises(distributed.InvariantModelError, match="BatchNorm bn runs 2 times per forward"):
        step([(x[:2], y[:2]), (x[2:], y[2:])], step=0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())   # nothing moved

    frozen = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(),
                                 torch.nn.LazyLinear(2))
    with pytest.raises(distributed.InvariantModelError, match="3 is a lazy module not yet initialised"):
        distributed.InvariantStep(frozen, group, batch=4, micro=2, seed=0)
    frozen(x[:2])
    frozen[1].eval()   # a frozen BatchNorm keeps its statistics but would have its batch count corrected
    with pytest.raises(distributed.InvariantModelError, match="BatchNorm 1 is in eval mode"):
        distributed.InvariantStep(frozen, group, batch=4, micro=2, seed=0).check_batchnorm_calls(x[:2])


def test_resume_restores_the_cuda_generators_it_has(monkeypatch):
    """A checkpoint written by a process that saw two GPUs, resumed by one that sees one
    (CUDA_VISIBLE_DEVICES=0): the first state is restored, the other left out (it had crashed with an
    IndexError in torch.cuda.set_rng_state_all)."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state)))
    s0, s1 = torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8)
    train._set_rng_states({"torch": torch.get_rng_state(), "cuda": [s0, s1], "numpy_kernel": None}, None)
    assert len(restored) == 1 and restored[0][0] == 0 and torch.equal(restored[0][1], s0)
