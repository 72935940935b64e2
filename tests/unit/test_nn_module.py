"""Module and Parameter: registration order, state dicts, modes, seeds, hooks."""
import numpy
import pytest

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import (
    Dropout, Linear, Module, ModuleList, Parameter, ReLU, Sequential, init,
)


class Block(Module):
    def __init__(self, rng):
        super().__init__()
        self.fc = Linear(3, 4, rng=rng)
        self.scale = Parameter(numpy.ones(4, dtype=numpy.float32))

    def forward(self, x):
        return F.mul(self.fc(x), self.scale)


class Net(Module):
    def __init__(self, seed=0):
        super().__init__()
        rng = numpy.random.default_rng(seed)
        self.first = Parameter(numpy.zeros(3, dtype=numpy.float32))
        self.block = Block(rng)
        self.blocks = ModuleList([Block(rng), Block(rng)])
        self.out = Linear(4, 2, rng=rng)
        self.drop = Dropout(0.5, seed=seed)

    def forward(self, x):
        x = F.add(x, self.first)
        x = self.block(x)
        x = self.out(F.relu(x))
        return self.drop(x)


def test_parameters_are_registered_in_definition_order_with_dotted_names():
    names = [n for n, _ in Net().named_parameters()]
    assert names == [
        "first", "block.fc.weight", "block.fc.bias", "block.scale",
        "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.scale",
        "blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.scale",
        "out.weight", "out.bias",
    ]
    assert [n for n, _ in Net().named_modules()][:4] == ["", "block", "block.fc", "blocks"]


def test_reassignment_keeps_position_and_plain_values_unregister():
    net = Net()
    net.block = Block(numpy.random.default_rng(1))
    names = [n for n, _ in net.named_parameters()]
    assert names[1] == "block.fc.weight"
    net.out = None
    assert "out.weight" not in dict(net.named_parameters()) and net.out is None


def test_missing_super_init_is_a_clear_error():
    class Bad(Module):
        def __init__(self):
            self.w = Parameter(numpy.ones(1))

    with pytest.raises(RuntimeError, match="super"):
        Bad()


def test_tied_parameter_is_listed_once():
    class Tied(Module):
        def __init__(self):
            super().__init__()
            self.a = Linear(2, 2, seed=0)
            self.b = Linear(2, 2, seed=1)
            self.b.weight = self.a.weight

    assert [n for n, _ in Tied().named_parameters()] == ["a.weight", "a.bias", "b.bias"]


def test_same_seed_gives_bit_identical_parameters_and_other_seeds_differ():
    a, b, c = Net(seed=3).state_dict(), Net(seed=3).state_dict(), Net(seed=4).state_dict()
    assert all(numpy.array_equal(a[k], b[k]) for k in a)
    assert not numpy.array_equal(a["out.weight"], c["out.weight"])
    assert all(v.dtype == numpy.float32 for v in a.values())
    with pytest.raises(ValueError, match="not both"):
        Linear(2, 2, seed=1, rng=numpy.random.default_rng(1))


def test_default_generator_is_reproducible_after_manual_seed():
    init.manual_seed(7)
    first = [Linear(3, 3).weight.data for _ in range(2)]
    init.manual_seed(7)
    again = [Linear(3, 3).weight.data for _ in range(2)]
    assert numpy.array_equal(first[0], again[0]) and numpy.array_equal(first[1], again[1])
    assert not numpy.array_equal(first[0], first[1])


def test_state_dict_round_trip_reproduces_outputs_exactly():
    x = numpy.random.default_rng(0).standard_normal((5, 3)).astype(numpy.float32)
    src, dst = Net(seed=1).eval(), Net(seed=2).eval()
    state = {k: v.copy() for k, v in src.state_dict().items()}
    arrays = [p.data for p in dst.parameters()]
    dst.load_state_dict(state)
    assert all(p.data is a for p, a in zip(dst.parameters(), arrays)), "must copy in place"
    numpy.testing.assert_array_equal(src(x).data, dst(x).data)


def test_state_dict_values_are_the_live_arrays():
    net = Net()
    assert all(v is p.data for v, p in zip(net.state_dict().values(), net.parameters()))


def test_load_state_dict_names_missing_unexpected_and_mismatched_keys():
    net = Net()
    state = dict(net.state_dict())
    del state["out.bias"]
    state["extra.weight"] = numpy.zeros(2)
    with pytest.raises(KeyError, match=r"missing keys \['out.bias'\].*unexpected keys "
                                       r"\['extra.weight'\]"):
        net.load_state_dict(state)
    net.load_state_dict(state, strict=False)  # loads what matches
    state = dict(net.state_dict())
    state["out.weight"] = numpy.zeros((3, 4))
    with pytest.raises(ValueError, match=r"out.weight: checkpoint \(3, 4\) vs model \(2, 4\)"):
        net.load_state_dict(state)


def test_train_and_eval_propagate_and_dropout_is_identity_in_eval():
    net = Net()
    x = numpy.ones((4, 3), dtype=numpy.float32)
    assert net.eval() is net and not net.drop.training and not net.blocks[1].training
    numpy.testing.assert_array_equal(net(x).data, net(x).data)
    net.train()
    assert net.drop.training


def test_dropout_masks_are_seeded():
    x = numpy.ones((64, 64), dtype=numpy.float32)
    a, b = Dropout(0.5, seed=5)(x).data, Dropout(0.5, seed=5)(x).data
    numpy.testing.assert_array_equal(a, b)
    assert 0.4 < (a == 0).mean() < 0.6 and set(numpy.unique(a)) == {0.0, 2.0}
    with pytest.raises(ValueError, match="p=1"):
        Dropout(1.0)


def test_zero_grad_drops_by_default_and_fills_in_place_on_request():
    net = Net().eval()
    loss = F.sum(net(numpy.ones((2, 3), dtype=numpy.float32)))
    loss.backward()
    used = [p for p in net.parameters() if p.grad is not None]  # net.blocks is unused
    grads = [p.grad for p in used]
    assert len(used) == 6
    net.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(used, grads))
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_gradient_hooks_fire_once_per_parameter_through_modules():
    net = Sequential(Linear(3, 4, seed=0), ReLU(), Linear(4, 2, seed=1))
    fired = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, name=name: fired.append(name))
    F.sum(net(numpy.ones((2, 3), dtype=numpy.float32))).backward()
    assert sorted(fired) == sorted(n for n, _ in net.named_parameters())
    # Backward reaches the last layer first: its gradients are ready first.
    assert set(fired[:2]) == {"2.weight", "2.bias"}


def test_sequential_indexes_and_iterates():
    seq = Sequential(Linear(2, 3, seed=0), ReLU())
    assert len(seq) == 2 and isinstance(seq[1], ReLU) and list(seq)[0] is seq[0]
    with pytest.raises(TypeError, match="argument 0"):
        Sequential(lambda x: x)
    assert "Linear(2, 3, bias=True)" in repr(seq)


def test_to_numpy_keeps_values_and_module_accepts_tensor_input():
    net = Net().eval()
    x = numpy.ones((1, 3), dtype=numpy.float32)
    before = net(Tensor(x)).data
    net.to(numpy)
    numpy.testing.assert_array_equal(net(x).data, before)


def test_num_parameters_counts_scalars():
    assert Linear(3, 4, seed=0).num_parameters() == 16


class Stats(Module):
    """A layer with a parameter between two buffers, and a None buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", numpy.zeros((), dtype=numpy.int64))
        self.scale = Parameter(numpy.ones(2))
        self.register_buffer("mean", numpy.zeros(2))
        self.register_buffer("unused", None)

    def forward(self, x):
        return F.mul(x, self.scale)


class WithStats(Module):
    def __init__(self):
        super().__init__()
        self.fc = Linear(2, 2, seed=0, dtype="float64")
        self.stats = Stats()


def test_buffers_are_state_but_not_parameters_in_registration_order():
    net = WithStats()
    assert [n for n, _ in net.named_parameters()] == ["fc.weight", "fc.bias", "stats.scale"]
    assert [n for n, _ in net.named_buffers()] == ["stats.count", "stats.mean"]
    assert list(net.state_dict()) == ["fc.weight", "fc.bias", "stats.count", "stats.scale",
                                      "stats.mean"]  # None buffers are left out
    assert net.state_dict()["stats.mean"] is net.stats.mean  # the live array
    assert net.stats.unused is None and net.num_parameters() == 8


def test_load_state_dict_restores_buffers_in_place_and_names_missing_ones():
    src, dst = WithStats(), WithStats()
    src.stats.count += 3
    src.stats.mean[...] = [1.5, -2.0]
    mean = dst.stats.mean
    dst.load_state_dict({k: v.copy() for k, v in src.state_dict().items()})
    assert dst.stats.mean is mean and list(mean) == [1.5, -2.0] and int(dst.stats.count) == 3
    state = dict(src.state_dict())
    del state["stats.mean"]
    with pytest.raises(KeyError, match=r"missing keys \['stats.mean'\]"):
        dst.load_state_dict(state)
    state["stats.mean"] = numpy.zeros(3)
    with pytest.raises(ValueError, match=r"stats.mean: checkpoint \(3,\) vs model \(2,\)"):
        dst.load_state_dict(state)


def test_assigning_a_buffer_replaces_it_in_place_in_the_order():
    s = Stats()
    s.mean = numpy.full(2, 7.0)
    assert list(s.state_dict()) == ["count", "scale", "mean"] and s.mean[0] == 7.0
    s.to(numpy)
    assert isinstance(s.mean, numpy.ndarray) and s.mean[1] == 7.0
    del s.mean
    assert "mean" not in s.state_dict()
    with pytest.raises(KeyError, match="already has an attribute 'count'"):
        s.register_buffer("count", numpy.zeros(1))
    with pytest.raises(TypeError, match="plain array"):
        s.register_buffer("w", Parameter(numpy.zeros(1)))


def test_reassigning_a_layer_keeps_its_place_in_repr_and_children():
    seq = Sequential(Linear(2, 3, seed=0), ReLU(), Linear(3, 1, seed=1))
    setattr(seq, "1", Dropout(0.1, seed=0))
    assert [type(m).__name__ for m in seq.children()] == ["Linear", "Dropout", "Linear"]
    assert repr(seq).index("Dropout") < repr(seq).rindex("Linear")
