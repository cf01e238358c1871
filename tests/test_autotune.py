"""fastest-deterministic: the per-shape tuner chooses only among deterministic candidates, caches its
choices per environment, obeys a pinned record, and its routed gradients are bitwise those of the
candidate it chose; runs record the choices and reproduce them on resume and from --autotune-plan."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import kernels
import nnrand
from nnrand import autotune, routing, runio, train
from tests.helpers import bitwise_equal

from .test_distributed import RUN, torchrun
from .test_train import tiny


def ranked_timer(order: list[str], seen: list | None = None, forward: list[str] | None = None):
    """A timer that ranks candidates by their position in ``order`` (first = fastest), without running
    them; ``forward``: the order for forward convs (``conv_fwd`` keys), ``order`` when None; ``seen``
    collects the names asked for."""
    def timer(fn, device):
        name = fn.__nnrand_name__
        if seen is not None:
            seen.append(name)
        rank = forward if forward is not None and fn.__nnrand_key__.startswith(routing.FORWARD_KEY + " ") else order
        return float(rank.index(name) + 1) if name in rank else 1e9
    return timer


@pytest.fixture(autouse=True)
def _named_candidates(monkeypatch):
    """Tag each candidate call with its name so ``ranked_timer`` can rank it (the tuner passes bare
    callables)."""
    real = autotune.Tuner._time

    def tagged(self, key, device, candidates):
        for name, fn in candidates.items():
            fn.__nnrand_name__, fn.__nnrand_key__ = name, key
        return real(self, key, device, candidates)
    monkeypatch.setattr(autotune.Tuner, "_time", tagged)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=2))


def grads(kernel="fastest-deterministic", tuner=None, ops=None, layout=torch.contiguous_format):
    m = net().to(memory_format=layout)
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1)).to(memory_format=layout)
    x.requires_grad_(True)
    with nnrand.use_kernels(kernel, ops, tuner=tuner) as r:
        m(x).square().sum().backward()
    return [x.grad] + [p.grad for p in m.parameters()], r


# --------------------------------------------------------------------------------------------------
# Resolution


def test_fastest_deterministic_resolves_to_auto_on_convs_and_tree_elsewhere():
    r = routing.resolve("fastest-deterministic")
    for op in routing.ROUTED_OPS:
        want = routing.AUTO if op in routing.TUNABLE else routing.family_variant("tree", op)
        assert r.used[op] == want, op
    assert r.tuned and r.claims_determinism
    assert routing.resolve("tree", {"conv_dgrad": "auto"}).used["conv_dgrad"] == "auto"
    with pytest.raises(routing.RoutingError, match="unknown variant 'auto' for op bias_grad"):
        routing.resolve("tree", {"bias_grad": "auto"})


# --------------------------------------------------------------------------------------------------
# The tuner on its own


def test_fastest_candidate_wins_and_ties_go_by_name(tmp_path):
    t = autotune.Tuner(cache=None, timer=lambda fn, dev: fn())
    assert t.choose("k1", torch.device("cpu"), {"b": lambda: 2.0, "a": lambda: 3.0}) == "b"
    assert t.choose("k2", torch.device("cpu"), {"b": lambda: 1.0, "a": lambda: 1.0}) == "a"
    assert t.record()["choices"]["k1"] == {"choice": "b", "times_us": {"b": 2.0, "a": 3.0}, "candidates": ["a", "b"],
                                           "source": "timed"}
    assert t.counts() == {"k1": {"b": 1}, "k2": {"a": 1}}


def test_a_candidate_that_refuses_the_shape_drops_out():
    def refuses():
        raise kernels.KernelArgumentError("conv_wgrad", "kernel_size", "not for this shape")
    t = autotune.Tuner(cache=None, timer=lambda fn, dev: fn())
    assert t.choose("k", torch.device("cpu"), {"a": refuses, "b": lambda: 5.0}) == "b"
    with pytest.raises(autotune.AutotuneError, match="no deterministic candidate runs"):
        t.choose("k2", torch.device("cpu"), {"a": refuses})


def test_disk_cache_is_reused_per_environment(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    autotune.Tuner(cache=path, timer=lambda fn, dev: fn()).choose("k", torch.device("cpu"),
                                                                  {"a": lambda: 2.0, "b": lambda: 1.0})

    def never(fn, dev):
        raise AssertionError("timed although the cache has the choice")
    again = autotune.Tuner(cache=path, timer=never)
    assert again.choose("k", torch.device("cpu"), {"a": None, "b": None}) == "b"
    assert again.record()["choices"]["k"]["source"] == "cache"
    # another environment (here: another thread count) times again
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    other = autotune.Tuner(cache=path, timer=lambda fn, dev: fn())
    assert other.choose("k", torch.device("cpu"), {"a": lambda: 1.0, "b": lambda: 2.0}) == "a"
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2 and all([v["choice"] for v in e.values()] in (["a"], ["b"]) for e in entries.values())
    # NVIDIA_TF32_OVERRIDE changes what torch's kernels compute without changing torch's flags: its own key
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    third = autotune.Tuner(cache=path, timer=lambda fn, dev: fn())
    assert third.choose("k", torch.device("cpu"), {"a": lambda: 2.0, "b": lambda: 1.0}) == "b"
    assert third.record()["choices"]["k"]["source"] == "timed" and third.record()["env"]["tf32_override"] == "0"
    assert len(json.loads(path.read_text())["entries"]) == 3


@pytest.mark.parametrize("text", ["{not json", "[]", "null", '{"version": 1, "entries": {}}'])
def test_unreadable_cache_warns_and_is_replaced(tmp_path, text):
    path = tmp_path / "autotune.json"
    path.write_text(text)
    t = autotune.Tuner(cache=path, timer=lambda fn, dev: fn())
    with pytest.warns(RuntimeWarning, match="unreadable|another format"):
        assert t.choose("k", torch.device("cpu"), {"a": lambda: 1.0}) == "a"
    assert json.loads(path.read_text())["version"] == autotune.CACHE_VERSION


def test_choices_hold_only_among_the_same_candidates(tmp_path):
    """A choice made while torch's kernel competed is not reused where it may not (deterministic mode
    off), and a choice made without it is not reused where it competes: in memory and on disk."""
    path = tmp_path / "autotune.json"
    t = autotune.Tuner(cache=path, timer=lambda fn, dev: fn())
    assert t.choose("k", torch.device("cpu"), {"torch_det": lambda: 1.0, "tree": lambda: 2.0}) == "torch_det"
    assert t.choose("k", torch.device("cpu"), {"tree": lambda: 2.0, "nosplit": lambda: 3.0}) == "tree"
    fresh = autotune.Tuner(cache=path, timer=lambda fn, dev: fn())
    assert fresh.choose("k", torch.device("cpu"), {"tree": lambda: 2.0, "torch_det": lambda: 9.0}) == "torch_det"
    assert fresh.record()["choices"]["k"]["source"] == "cache"
    other = autotune.Tuner(cache=path, timer=lambda fn, dev: fn())
    assert other.choose("k", torch.device("cpu"), {"nosplit": lambda: 3.0, "tree": lambda: 5.0}) == "tree"
    assert other.record()["choices"]["k"]["source"] == "cache"


def test_a_choice_stored_meanwhile_by_another_process_is_adopted(tmp_path):
    """Two processes timing one shape at once: the second to finish takes the first's choice."""
    path = tmp_path / "autotune.json"
    first = autotune.Tuner(cache=path, timer=lambda fn, dev: fn())
    second = autotune.Tuner(cache=path, timer=lambda fn, dev: (first.choose("k", dev, {"a": lambda: 1.0,
                                                                                     "b": lambda: 2.0}), fn())[1])
    assert second.choose("k", torch.device("cpu"), {"a": lambda: 9.0, "b": lambda: 2.0}) == "a"
    assert second.record()["choices"]["k"]["source"] == "cache"


def test_pinned_record_wins_and_pinned_only_refuses_new_shapes():
    t = autotune.Tuner(cache=None, pinned={"choices": {"k": {"choice": "a"}}}, pinned_only=True,
                       timer=lambda fn, dev: fn())
    assert t.choose("k", torch.device("cpu"), {"a": lambda: 9.0, "b": lambda: 1.0}) == "a"
    assert t.record()["choices"]["k"]["source"] == "pinned"
    with pytest.raises(autotune.AutotuneError, match="k2 is not in the pinned autotune record"):
        t.choose("k2", torch.device("cpu"), {"a": lambda: 1.0})
    t = autotune.Tuner(cache=None, pinned={"k": "c"})
    with pytest.raises(autotune.AutotuneError, match="pinned choice 'c' is not a deterministic candidate"):
        t.choose("k", torch.device("cpu"), {"a": lambda: 1.0})


# --------------------------------------------------------------------------------------------------
# Routed: candidates, and bits equal to the chosen candidate's


def test_only_deterministic_candidates_are_timed():
    seen: list[str] = []
    grads(tuner=autotune.Tuner(cache=None, timer=ranked_timer(["tree"], seen)))
    deterministic = {v.name for op in routing.TUNABLE for v in kernels.variants(op) if v.deterministic}
    assert set(seen) == deterministic | {autotune.TORCH_DET}
    assert "atomic" not in seen


def test_torch_kernel_is_no_candidate_outside_deterministic_mode():
    """conv_dgrad=auto beside an atomic op: the routing claims no determinism, PyTorch's deterministic
    mode stays off, so torch's kernel (cuDNN's nondeterministic algorithms on a GPU) must not compete."""
    seen: list[str] = []
    _, r = grads("atomic", autotune.Tuner(cache=None, timer=ranked_timer([autotune.TORCH_DET, "tree"], seen)),
                 ops={"conv_dgrad": "auto"})
    assert not r.routing.claims_determinism
    assert seen and autotune.TORCH_DET not in seen
    assert all(c["choice"] == "tree" for c in r.tuner.record()["choices"].values())


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_routed_bits_are_the_chosen_candidates(layout):
    tree, _ = grads("tree", layout=layout)
    # the forward convs torch's, as under tree
    auto_tree, r = grads(tuner=autotune.Tuner(cache=None, timer=ranked_timer(["tree"], forward=[autotune.TORCH_DET])),
                         layout=layout)
    for a, b in zip(tree, auto_tree):
        assert bitwise_equal(a, b)
    assert r.coverage["convolution_backward"] == {"tree": 3}
    # the stride-1 ungrouped conv is the one forward the tuner chose for; the others are not its to take
    assert r.coverage["convolution"] == {"torch_det": 1, "original": 2}
    # torch's kernel chosen everywhere: the gradients are torch's (its CPU conv backward), the channel
    # reductions still tree's
    native, _ = grads("tree", ops={op: "native" for op in routing.TUNABLE}, layout=layout)
    auto_torch, r = grads(tuner=autotune.Tuner(cache=None, timer=ranked_timer([autotune.TORCH_DET])), layout=layout)
    for a, b in zip(native, auto_torch):
        assert bitwise_equal(a, b)
    assert r.coverage["convolution_backward"] == {"torch_det+tree": 3}  # every conv has a bias: tree
    keys = list(r.tuner.record()["choices"])
    assert any(k.startswith("conv_dgrad_grouped ") and " g=2 " in k for k in keys)
    want = "channels_last" if layout == torch.channels_last else "nchw"
    assert all(k.endswith(f" {want} float32") for k in keys)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_forward_conv_runs_the_chosen_candidate(layout):
    """conv_dgrad routed auto tunes the stride-1 forward convs too: with its tree form chosen, the first
    conv's output is bitwise the forward form's (conv_dgrad's tree model on flipped, transposed weights)
    plus the bias, in torch's layout, within the float32 bound of torch's own conv; gradients still flow."""
    m = net().to(memory_format=layout)
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(1)).to(memory_format=layout)
    x.requires_grad_(True)
    seen = {}
    m[0].register_forward_hook(lambda mod, inp, out: seen.update(y=out.detach().clone()))   # returns None
    tuner = autotune.Tuner(cache=None, timer=ranked_timer([autotune.TORCH_DET], forward=["tree"]))
    with nnrand.use_kernels("fastest-deterministic", tuner=tuner) as r:
        m(x).square().sum().backward()
        assert "convolution" in r.aten_ops
    assert r.coverage["convolution"] == {"tree": 1, "original": 2}
    (key,) = [k for k in tuner.record()["choices"] if k.startswith("conv_fwd ")]
    want_layout = "channels_last" if layout == torch.channels_last else "nchw"
    assert key == f"conv_fwd x=4x3x12x12 w=8x3x3x3 s=1x1 p=1x1 d=1x1 g=1 {want_layout} float32"
    w, b = m[0].weight.detach(), m[0].bias.detach()
    expect = kernels.conv_dgrad.conv_forward_tree_cpu(x.detach(), w, padding=1) + b.view(1, -1, 1, 1)
    y = seen["y"]
    assert bitwise_equal(y, expect)
    assert y.is_contiguous(memory_format=layout)
    # the tree model sums the Cin = 3 products of a tap in a float32 matmul, then adds the 9 taps into +0.0:
    # k = Cin + KH*KW + 1 roundings per product, |error| <= gamma_k * sum |x||w| (gamma_k = k u / (1 - k u),
    # u = 2^-24); plus the bias addition's one rounding, <= u |y|
    k, u = 3 + 9 + 1, 2.0 ** -24
    mag = torch.nn.functional.conv2d(x.detach().double().abs(), w.double().abs(), None, 1, 1)
    ref = torch.nn.functional.conv2d(x.detach().double(), w.double(), b.double(), 1, 1)
    bound = k * u / (1 - k * u) * mag + u * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())


def test_winograd_forward_is_a_candidate_where_it_applies():
    """A float32 3x3 stride-1 conv with at least 16 channels each side offers the Winograd forward too
    (chosen here: its output is the Winograd model's plus the bias, bitwise); a 3-channel one does not."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 24, 3, padding=1))
    x = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(2), requires_grad=True)
    seen = {}
    m[1].register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0].detach().clone(), y=out.detach().clone()))
    # winograd ranks first wherever offered: the 3-channel conv's tree choice shows it was not offered there
    tuner = autotune.Tuner(cache=None, timer=ranked_timer([autotune.TORCH_DET], forward=["winograd", "tree"]))
    with nnrand.use_kernels("fastest-deterministic", tuner=tuner) as r:
        m(x).square().sum().backward()
    assert r.coverage["convolution"] == {"tree": 1, "winograd": 1}
    choices = {k: v["choice"] for k, v in tuner.record()["choices"].items() if k.startswith("conv_fwd ")}
    assert sorted(choices.values()) == ["tree", "winograd"]
    w, b = m[1].weight.detach(), m[1].bias.detach()
    want = kernels.conv_dgrad_winograd.conv_forward_winograd_cpu(seen["x"], w, padding=1) + b.view(1, -1, 1, 1)
    assert bitwise_equal(seen["y"], want)
    assert all(p.grad is not None for p in m.parameters())


def test_forward_conv_missing_from_a_pinned_plan_runs_torch():
    """A pinned-only record without forward keys (a plan made before forward convs were tuned, or an
    evaluation batch it never met): the forward runs torch's kernel, untimed, and backward keys still pin."""
    first, r = grads(tuner=autotune.Tuner(cache=None, timer=ranked_timer(["tree"], forward=["tree"])))
    backward_only = {k: v for k, v in r.tuner.record()["choices"].items() if not k.startswith("conv_fwd ")}
    assert len(backward_only) < len(r.tuner.record()["choices"])
    seen: list[str] = []
    again, r2 = grads(tuner=autotune.Tuner(cache=None, pinned={"choices": backward_only}, pinned_only=True,
                                           timer=ranked_timer(["tree"], seen)))
    assert seen == []
    assert r2.coverage["convolution"] == {"torch_det": 1, "original": 2}
    reference, _ = grads(tuner=autotune.Tuner(cache=None, timer=ranked_timer(["tree"], forward=[autotune.TORCH_DET])))
    assert all(bitwise_equal(a, b) for a, b in zip(again, reference))


def test_forward_conv_tuning_leaves_evaluation_strided_inputs_and_refusals_to_torch():
    """Only forwards that record a backward are tuned: under no_grad (evaluation) torch's forward runs,
    untimed. A channel slice of a channels_last tensor (dense in neither layout) goes to torch. A pinned
    tree choice the launcher refuses (bf16 on the CPU, which the CPU model does not take) runs torch's
    forward, counted with the reason. The output follows torch's layout rule: channels_last when the
    weight is, even for an NCHW input."""
    torch.manual_seed(4)   # the convs' initial weights
    conv = nn.Conv2d(4, 6, 3, padding=1)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 7, 7, generator=gen)
    seen: list[str] = []
    tuner = autotune.Tuner(cache=None, timer=ranked_timer(["tree"], seen))
    with nnrand.use_kernels("fastest-deterministic", tuner=tuner) as r:
        with torch.no_grad():
            plain = conv(x)
        sliced = torch.randn(2, 8, 7, 7, generator=gen).to(memory_format=torch.channels_last)[:, :4]
        assert not sliced.is_contiguous() and not sliced.is_contiguous(memory_format=torch.channels_last)
        conv(sliced)
        conv_cl = nn.Conv2d(4, 6, 3, padding=1).to(memory_format=torch.channels_last)
        y = conv_cl(x)
    assert seen == ["tree", autotune.TORCH_DET]   # the one tuned call: conv_cl's, with grad
    cov = r.coverage.as_dict()["convolution"]
    assert cov == {"original": 2, "tree": 1}
    assert bitwise_equal(plain, torch.nn.functional.conv2d(x, conv.weight, conv.bias, 1, 1))
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    half = nn.Conv2d(8, 8, 3, padding=1).to(torch.bfloat16)
    xb = torch.randn(2, 8, 6, 6, generator=gen).to(torch.bfloat16)
    key = autotune.conv_key("conv_fwd", xb, half.weight, (1, 1), (1, 1), (1, 1), 1, "nchw")
    with nnrand.use_kernels("fastest-deterministic", tuner=autotune.Tuner(cache=None, pinned={key: "tree"})) as r2:
        yb = half(xb)
    assert r2.coverage.as_dict()["convolution"] == {"original": 1}
    assert any(why.startswith("conv_dgrad") for why in r2.coverage.reasons["convolution"]), r2.coverage.reasons
    assert bitwise_equal(yb, torch.nn.functional.conv2d(xb, half.weight, half.bias, 1, 1))


def test_forward_conv_is_not_tuned_outside_deterministic_mode():
    """conv_dgrad=auto under atomic: torch's forward keeps its own algorithm choice, nothing is timed for it."""
    _, r = grads("atomic", autotune.Tuner(cache=None, timer=ranked_timer(["tree"])), ops={"conv_dgrad": "auto"})
    assert not any(k.startswith("conv_fwd ") for k in r.tuner.record()["choices"])
    assert r.coverage["convolution"] == {"original": 3}


def test_same_choices_same_bits_across_tuners(tmp_path):
    """Two processes' worth of tuners sharing one cache: the second reads the first's choices."""
    path = tmp_path / "a.json"
    first, _ = grads(tuner=autotune.Tuner(cache=path, timer=ranked_timer(["winograd", "tree", autotune.TORCH_DET])))
    second, r = grads(tuner=autotune.Tuner(cache=path, timer=ranked_timer([autotune.TORCH_DET])))
    for a, b in zip(first, second):
        assert bitwise_equal(a, b)
    assert {c["source"] for c in r.tuner.record()["choices"].values()} == {"cache"}


# --------------------------------------------------------------------------------------------------
# Runs


def test_run_records_choices_and_a_plan_reproduces_them(tmp_path):
    kw = dict(kernel="fastest-deterministic", epochs=2)
    a = train.main(tiny(tmp_path, "a", **kw))["members"][0]
    da = runio.member_dir(tmp_path, "a", 0)
    rec = runio.read_json(da / "config.json")["autotune"]
    assert rec["choices"] and {c["source"] for c in rec["choices"].values()} == {"timed"}
    assert sum(sum(c.values()) for c in a["autotune"].values()) == len(rec["choices"])
    b = train.main(tiny(tmp_path, "b", autotune_plan=str(da / "config.json"), **kw))["members"][0]
    recb = runio.read_json(runio.member_dir(tmp_path, "b", 0) / "config.json")["autotune"]
    assert {k: c["choice"] for k, c in recb["choices"].items()} == {k: c["choice"] for k, c in rec["choices"].items()}
    assert {c["source"] for c in recb["choices"].values()} == {"pinned"}
    assert a["final_checksum"] == b["final_checksum"] and a["logits_hash"] == b["logits_hash"]


def test_resume_keeps_the_checkpoints_choices(tmp_path, monkeypatch):
    kw = dict(kernel="fastest-deterministic", epochs=2)
    straight = train.main(tiny(tmp_path, "straight", **kw))["members"][0]
    with pytest.raises(KeyboardInterrupt):
        train.main(tiny(tmp_path, "resumed", interrupt_at_step=3, **kw))
    d = runio.member_dir(tmp_path, "resumed", 0)
    chosen = {k: c["choice"] for k, c in runio.read_json(d / "config.json")["autotune"]["choices"].items()}
    # a new timing would now choose otherwise; the resumed run must keep what it chose before
    monkeypatch.setenv("NNRAND_CACHE_DIR", str(tmp_path / "fresh_cache"))
    monkeypatch.setattr(autotune, "time_us", lambda fn, dev: 1.0)
    resumed = train.main(tiny(tmp_path, "resumed", **kw))["members"][0]
    rec = runio.read_json(d / "config.json")["autotune"]["choices"]
    assert {k: c["choice"] for k, c in rec.items()} == chosen
    assert {c["source"] for c in rec.values()} == {"pinned"}
    assert straight["final_checksum"] == resumed["final_checksum"]


@pytest.mark.parametrize("env,argv,message", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--kernel", "fastest-deterministic"], "need --autotune-plan"),
    ({}, ["--kernel", "tree", "--autotune-plan", "x.json"], "--autotune-plan applies to"),
    ({}, ["--kernel", "fastest-deterministic", "--autotune-plan", "{tmp}/missing.json"], "no such file"),
    ({}, ["--kernel", "fastest-deterministic", "--autotune-plan", "{tmp}/plain.json"], "no autotune record"),
])
def test_bad_autotune_options_fail_before_training(monkeypatch, capsys, tmp_path, env, argv, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "plain.json").write_text('{"member": 0}')
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as e:
        train.cli(["--device", "cpu", "--no-progress", "--out", str(out),
                   *[a.replace("{tmp}", str(tmp_path)) for a in argv]])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_two_processes_run_from_a_plan(tmp_path):
    """torchrun (gloo): with a one-process run's record pinned, both ranks make the same choices and
    none is timed; a plan recorded at another per-process batch is refused, naming the shape."""
    base = [a for a in RUN if a not in ("tree",)]
    base[base.index("--kernel") + 1:base.index("--kernel") + 1] = ["fastest-deterministic"]
    # the plan's shapes are per process: one process with the 2-process run's per-rank batch
    one = train.cli([*base, "--batch-size", "16", "--out", str(tmp_path / "one"), "--name", "run"])
    assert one == 0
    plan = runio.member_dir(tmp_path / "one", "run", 0) / "config.json"
    r = torchrun(2, tmp_path / "two", "--kernel", "fastest-deterministic", "--autotune-plan", str(plan))
    assert r.returncode == 0, r.stderr[-3000:]
    wrong = torchrun(2, tmp_path / "wrong", "--kernel", "fastest-deterministic", "--autotune-plan", str(plan),
                     "--batch-size", "64")
    assert wrong.returncode != 0 and "x=32x" in wrong.stderr and "not in the pinned autotune record" in wrong.stderr
    rec = runio.read_json(runio.member_dir(tmp_path / "two", "run", 0) / "config.json")["autotune"]["choices"]
    assert {c["source"] for c in rec.values()} == {"pinned"}
    assert {k: c["choice"] for k, c in rec.items()} == \
        {k: c["choice"] for k, c in runio.read_json(plan)["autotune"]["choices"].items()}


def test_no_choice_during_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(autotune, "environment", lambda device: {"device": "a GPU"})  # no GPU to ask here
    t = autotune.Tuner(cache=None, timer=lambda fn, dev: 1.0)
    with pytest.raises(autotune.AutotuneError, match="while a CUDA graph was being captured"):
        t.choose("k", torch.device("cuda"), {"a": lambda: None})
    # a choice made before capture is served during it
    t.choices["k"] = {"choice": "a", "source": "timed", "candidates": ["a"]}
    assert t.choose("k", torch.device("cuda"), {"a": lambda: None}) == "a"


def test_a_plan_made_under_another_cudnn_heuristic_is_refused(tmp_path):
    """A plan's torch_det choices ran its process's cuDNN heuristic: a CUDA run under the other one would not
    run the planning run's algorithms, so --autotune-plan names the heuristic to pass."""
    record = {"autotune": {"choices": {"conv_dgrad k": {"choice": "tree"}}}}
    for name, flags in (("b", {"cudnn_heuristic": "b"}), ("instant", {"cudnn_heuristic": "instant"}), ("old", {})):
        (tmp_path / f"{name}.json").write_text(json.dumps({**record, "flags": flags}))
    with pytest.raises(train.ConfigError, match=r"made under --cudnn-heuristic b; this run has instant: pass "
                                                r"--cudnn-heuristic b to follow it$"):
        train.check_plan_heuristic(str(tmp_path / "b.json"), "instant")
    train.check_plan_heuristic(str(tmp_path / "b.json"), "b")
    train.check_plan_heuristic(str(tmp_path / "instant.json"), "instant")
    for mode in ("instant", "b"):   # a plan from before runs recorded the heuristic: followed as it is
        train.check_plan_heuristic(str(tmp_path / "old.json"), mode)
    # a CPU run has no cuDNN: its plan check does not look at the heuristic
    cfg = train.Config(**tiny(tmp_path, "r", kernel="fastest-deterministic", autotune_plan=str(tmp_path / "b.json")))
    assert train.resolve(cfg).autotune_plan.endswith("b.json")
