"""One GPU: the world-invariant step with each micro-batch a graph replay gives eager's bits on a model with
dropout (its draws reseeded per micro-batch before every replay) and a parameter that gets no gradient (it
stays without one). A negative control shows that the dropout draws matter: another seed, other weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nnrand
from nnrand import distributed
from tests.helpers import bitwise_equal

pytestmark = pytest.mark.gpu

MICRO, PER_STEP, STEPS = 4, 4, 3   # 4 micro-batches of 4 images per step


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(8, 10)
        self.unused = nn.Linear(4, 4)   # never called: no gradient on any micro-batch

    def forward(self, x):
        h = self.drop(F.relu(self.bn(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def _train(graph: bool, seed: int = 7):
    torch.manual_seed(0)
    net = DropNet().cuda()
    group = distributed.Group(distributed.World(), torch.device("cuda"))
    step = distributed.InvariantStep(net, group, batch=MICRO * PER_STEP, micro=MICRO, seed=seed, graph=graph)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(STEPS, MICRO * PER_STEP, 3, 8, 8, device="cuda", generator=g)
    y = torch.randint(0, 10, (STEPS, MICRO * PER_STEP), device="cuda", generator=g)
    metrics = []
    with nnrand.use_kernels("tree", model=net):
        for s in range(STEPS):
            batches = [(x[s, j * MICRO:(j + 1) * MICRO], y[s, j * MICRO:(j + 1) * MICRO]) for j in range(PER_STEP)]
            metrics.append(step(batches, s))
            opt.step()
    torch.cuda.synchronize()
    return net, torch.stack(metrics)


def test_captured_micro_batches_give_eager_bits_with_dropout_and_an_unused_parameter():
    eager, m_eager = _train(graph=False)
    graph, m_graph = _train(graph=True)
    for (name, a), b in zip(eager.state_dict().items(), graph.state_dict().values()):
        assert bitwise_equal(a, b), name   # weights, BatchNorm statistics and batch counter
    assert bitwise_equal(m_eager, m_graph)
    assert eager.unused.weight.grad is None and graph.unused.weight.grad is None
    assert bitwise_equal(eager.unused.weight, graph.unused.weight)
    other, _ = _train(graph=True, seed=8)   # negative control: other dropout draws, other weights
    assert not torch.equal(other.conv.weight, graph.conv.weight)
