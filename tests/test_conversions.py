"""model.double(), .half(), .to(device) after construction never silently stop training."""

import numpy as np
import pytest
import torch

import speedswap as ss

ROWS, DIM = 50, 4


def snapshot(model):
    """Every parameter's and buffer's tensor (and gradient), copied, by name."""
    tensors = {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    tensors.update({name + ".grad": p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    return tensors


def assert_unchanged(model, before):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert (after[name].dtype, after[name].device) == (tensor.dtype, tensor.device), name
        # equal_nan: after a to_empty() between steps the dense layers hold uninitialised memory, NaN included.
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, equal_nan=True, msg=name)


def assert_to_empty_refused(model, match):
    """``model.to_empty(device="cpu")`` raises a StateError matching ``match`` and changes nothing."""
    before = snapshot(model)
    with pytest.raises(ss.StateError, match=match):
        model.to_empty(device="cpu")
    assert_unchanged(model, before)


@pytest.mark.parametrize("kind", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
def test_embedding_refuses_a_conversion_before_anything_converts_and_keeps_training(rng, kind):
    """torch converts a model's submodules in turn: the Linear (and the BatchNorm's buffers) before
    the embedding were converted, then the embedding refused, leaving a half-converted model."""
    emb = kind(ROWS, DIM, max_rows=8, storage="pageable", backend="numpy")
    dense = torch.nn.Linear(DIM, DIM)
    norm = torch.nn.BatchNorm1d(DIM)
    model = torch.nn.Sequential(torch.nn.Sequential(dense, norm), emb, torch.nn.Linear(DIM, 1))
    with torch.no_grad():
        for p in [*model[0].parameters(), *model[2].parameters()]:  # emb.weight is scratch
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape), dtype=np.float32)))
    norm(torch.from_numpy(rng.standard_normal((5, DIM), dtype=np.float32)))  # non-trivial running stats
    dense(torch.from_numpy(rng.standard_normal((3, DIM), dtype=np.float32))).sum().backward()
    before = snapshot(model)
    conversions = [model.double, model.half, model.bfloat16, lambda: model.to(torch.float64),
                   lambda: model.to(dtype=torch.float16), lambda: model.type(torch.float64),
                   lambda: model.to("meta"), lambda: model.to_empty(device="meta")]
    # The example of converting the rest alone converts as the call did (it said .double() after a .half()).
    examples = ["torch.float64", "torch.float16", "torch.bfloat16", "torch.float64", "torch.float16",
                "torch.float64", "'meta'", "'meta'"]
    for convert, example in zip(conversions, examples):
        with pytest.raises(ss.OptionError, match="cannot be converted") as refused:
            convert()
        assert_unchanged(model, before)
        assert "converted already" not in str(refused.value)
        assert f"(e.g. model.head.to({example}))" in str(refused.value)
    model.float()           # what it already is: fine
    model.to("cpu")
    assert_unchanged(model, before)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    emb.attach(opt)
    table = emb.table.to_numpy(copy=True)
    ids = torch.from_numpy(rng.choice(ROWS, size=6, replace=False))
    emb(ids).sum().backward()
    opt.step()
    opt.zero_grad()
    after = emb.table.to_numpy()
    np.testing.assert_allclose(after[ids.numpy()], table[ids.numpy()] - 0.5)
    untouched = np.setdiff1d(np.arange(ROWS), ids.numpy())
    np.testing.assert_array_equal(after[untouched], table[untouched])


def test_models_without_an_offloaded_embedding_convert_as_torch_converts_them(rng):
    """Once an embedding was built, nn.Module._apply checks each tree first: others convert as before."""
    ss.OffloadedEmbedding(ROWS, DIM, max_rows=8, storage="pageable", backend="numpy")
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.BatchNorm1d(DIM)),
                                torch.nn.Linear(DIM, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape), dtype=np.float32)))
    before = snapshot(model)
    model.double()
    after = snapshot(model)
    for name, tensor in before.items():
        expected = tensor.double() if tensor.is_floating_point() else tensor
        assert after[name].dtype == expected.dtype, name
        torch.testing.assert_close(after[name], expected, rtol=0, atol=0, msg=name)


def _switched_model(rng, optimizer=torch.optim.Adam):
    """A Linear, then a 16-slot working-set embedding with both switchers over a random table."""
    emb = torch.nn.Embedding(16, DIM)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ModuleDict({"e": emb}))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape), dtype=np.float32)))
    opt = optimizer(emb.parameters(), lr=0.1)
    u = ss.ModelFactory(emb, ROWS, DIM, CPUPinn=True, backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model[1], "e", CPUPinn=True, backend="numpy")
    return model, emb, opt, u, o


CONVERSIONS = {"double": lambda m: m.double(), "half": lambda m: m.half(), "bfloat16": lambda m: m.bfloat16(),
               "to(float64)": lambda m: m.to(torch.float64), "type(float64)": lambda m: m.type(torch.float64),
               "to(meta)": lambda m: m.to("meta"), "to_empty(meta)": lambda m: m.to_empty(device="meta")}


@pytest.mark.parametrize("mid_step", [False, True])
def test_switchers_refuse_a_conversion_before_anything_converts_and_keep_training(rng, mid_step):
    """model.double() after the switchers were built converted the whole model (the embedding's slots
    too) and only the next before_forward raised; converted between before_forward and after_step,
    the step could not end (after_step raised, then before_forward 'called twice')."""
    model, emb, opt, u, o = _switched_model(rng, torch.optim.SGD)
    ids = torch.from_numpy(rng.zipf(1.3, 12) % ROWS)
    if mid_step:
        local = u.before_forward(ids)
        o.before_forward(ids)
    table = u.getNumpyVersion()
    before = snapshot(model)
    for name, convert in CONVERSIONS.items():
        with pytest.raises(ss.OptionError, match="cannot be converted") as refused:
            convert(model)
        assert "build the switchers after it" in str(refused.value), name
        assert_unchanged(model, before)
    model.float()  # what it already is: fine
    model.to("cpu")
    assert_unchanged(model, before)
    if not mid_step:
        local = u.before_forward(ids)
        o.before_forward(ids)
    weights = torch.from_numpy(rng.standard_normal((len(ids), DIM), dtype=np.float32))
    (emb(local) * weights).sum().backward()
    opt.step()
    opt.zero_grad()
    u.after_step(ids)
    o.after_step(ids)
    expected = torch.from_numpy(table).requires_grad_()  # the whole table in memory, plain SGD
    (expected[ids] * weights).sum().backward()
    np.testing.assert_allclose(u.getNumpyVersion(), (expected - 0.1 * expected.grad).detach().numpy(),
                               rtol=1e-6, atol=1e-6)
    u.close()
    o.close()
    model.double()  # no switcher serves it any more
    assert emb.weight.dtype == torch.float64


def test_switchers_refuse_a_weight_converted_around_the_module_walk(rng):
    """A conversion no nn.Module._apply made (weight.data assigned) is still refused at before_forward."""
    model, emb, opt, u, o = _switched_model(rng)
    table = u.to_numpy(copy=True)
    emb.weight.data = emb.weight.data.double()
    ids = torch.tensor([3, 7, 3])
    with pytest.raises(ss.OptionError, match="converted to torch.float64"):
        u.before_forward(ids)
    with pytest.raises(ss.OptionError, match="build the switchers after it"):
        o.before_forward(ids)
    np.testing.assert_array_equal(u.to_numpy(), table)  # nothing changed
    assert u._steps.current is None


def test_switchers_refuse_a_weight_replaced_after_them():
    """A new weight in the module's place: the switchers would fill the old one. load_state_dict(assign=True)
    is refused at the load (the weight stays), another Parameter assigned by the next step."""
    model = torch.nn.Embedding(8, DIM)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    holder = torch.nn.ModuleDict({"e": model})
    u = ss.ModelFactory(model, ROWS, DIM, CPUPinn=True, backend="numpy")
    o = ss.OptimizerFactory(opt, ROWS, DIM, holder, "e", CPUPinn=True, backend="numpy")
    weight = model.weight
    with pytest.raises(ss.OptionError, match="assign=True"):
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert model.weight is weight
    model.weight = torch.nn.Parameter(weight.detach().clone())
    for switcher in (u, o):
        with pytest.raises(ss.OptionError, match="weight was replaced"):
            switcher.before_forward(torch.tensor([1, 2]))


def test_switchers_refuse_a_working_set_with_a_padding_slot():
    """Its slots hold other rows every step: the padding slot would freeze the batch's smallest id."""
    model = torch.nn.Embedding(8, DIM, padding_idx=0)
    with pytest.raises(ss.OptionError, match="padding_idx=0"):
        ss.ModelFactory(model, ROWS, DIM, backend="numpy")
    with pytest.raises(ss.OptionError, match="padding_idx=0"):
        ss.OptimizerFactory(torch.optim.SGD(model.parameters(), lr=0.1), ROWS, DIM,
                            torch.nn.ModuleDict({"e": model}), "e", backend="numpy")


@pytest.mark.parametrize("kind", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
def test_a_bfloat16_embedding_refuses_bfloat16_saying_it_is_bfloat16_already(kind):
    """It said "build it with dtype=...", but it was built with dtype=torch.bfloat16: its weight is float32 by design."""
    emb = kind(ROWS, DIM, max_rows=8, storage="pageable", backend="numpy", dtype=torch.bfloat16)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 1), emb)
    with pytest.raises(ss.OptionError, match="cannot be converted") as refused:
        model.bfloat16()
    message = str(refused.value)
    assert "table is torch.bfloat16 already" in message and "float32 by design" in message
    assert "build it with dtype" not in message
    assert emb.weight.dtype is torch.float32
    with pytest.raises(ss.OptionError, match="build it with dtype=") as other:
        model.double()  # to another dtype than the table's, building it so is the way
    assert "bfloat16 already" not in str(other.value)


def _zipf_batch(rng):
    """Fresh Zipf-distributed ids (repeats likely) and a random loss weight row for each: ``(ids, weights)``."""
    ids = torch.from_numpy(rng.zipf(1.3, 12) % ROWS)
    return ids, torch.from_numpy(rng.standard_normal((len(ids), DIM), dtype=np.float32))


def _sgd_in_memory(expected, ids, weights):
    """Step ``expected``, the whole table in memory, in place as plain SGD (lr 0.1) on ``(table[ids] * weights).sum()``."""
    expected -= 0.1 * torch.zeros_like(expected).index_add_(0, ids, weights)


@pytest.mark.parametrize("kind", ["offloaded", "switchers"])
def test_to_empty_on_its_own_device_mid_step_is_refused_and_between_steps_trains_on(rng, kind):
    """to_empty(device="cpu") changes no dtype or device, so it went through, between a training
    forward and the step too: the working set, which held the step's rows, became uninitialised
    memory, and the step wrote it back to the table as trained rows (values like 1e37)."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    expected = torch.from_numpy(table0.copy())  # the whole table in memory, plain SGD
    if kind == "offloaded":
        emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=16, storage="pageable", backend="numpy")
        emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
        model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), emb)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        emb.attach(opt)
        begin, end, read = emb, lambda ids: None, lambda: emb.table.to_numpy(copy=True)
    else:
        model, emb, opt, u, o = _switched_model(rng, torch.optim.SGD)
        u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))

        def begin(ids):
            o.before_forward(ids)
            return emb(u.before_forward(ids))

        def end(ids):
            u.after_step(ids)
            o.after_step(ids)
        read = u.getNumpyVersion
    for _ in range(4):
        ids, weights = _zipf_batch(rng)
        rows = begin(ids)
        assert_to_empty_refused(model, "convert between steps")
        (rows * weights).sum().backward()
        opt.step()
        opt.zero_grad()
        end(ids)
        _sgd_in_memory(expected, ids, weights)
        np.testing.assert_allclose(read(), expected.numpy(), rtol=1e-6, atol=1e-6)
        model.to_empty(device="cpu")  # between steps the working set is scratch


def _sharded_model(rng):
    """A one-rank ShardedOffloadedEmbedding of a random table after a Linear, with SGD, and its table in memory."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=16, storage="pageable", backend="numpy")
    emb.table.scatter(torch.arange(ROWS), torch.from_numpy(table0))
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), emb)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    return emb, model, opt, torch.from_numpy(table0.copy())  # the whole table in memory, for plain SGD


def test_sharded_to_empty_on_its_own_device_mid_step_is_refused(rng):
    """A ShardedOffloadedEmbedding (one rank) took to_empty(device="cpu") between a training forward
    and the step: the step then trained the new, uninitialised weight and wrote back the rows it had
    gathered, unstepped: the step's update was lost, silently (its rows off by up to 0.34)."""
    emb, model, opt, expected = _sharded_model(rng)
    for _ in range(4):
        ids, weights = _zipf_batch(rng)
        rows = emb(ids)
        assert_to_empty_refused(model, "convert between steps")
        (rows * weights).sum().backward()
        assert_to_empty_refused(model, "convert between steps")
        opt.step()
        opt.zero_grad()
        _sgd_in_memory(expected, ids, weights)
        np.testing.assert_allclose(emb.table.to_numpy(copy=True), expected.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_sharded_to_empty_on_its_own_device_between_steps_trains_on(rng, set_to_none):
    """A ShardedOffloadedEmbedding (one rank) took to_empty(device="cpu") between steps, and from then
    on every step trained the new storage of weight while writing back the rows its forwards had
    gathered into the old one, unstepped: training stopped, silently (rows off by 0.31 after 2 steps)."""
    emb, model, opt, expected = _sharded_model(rng)
    for _ in range(4):
        model.to_empty(device="cpu")  # between steps weight is scratch: the table is not touched
        ids, weights = _zipf_batch(rng)
        (emb(ids) * weights).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        _sgd_in_memory(expected, ids, weights)
        np.testing.assert_allclose(emb.table.to_numpy(copy=True), expected.numpy(), rtol=1e-6, atol=1e-6)


def test_to_empty_between_steps_over_a_zeroed_gradient_is_refused_and_after_zero_grad_trains_on(rng):
    """After zero_grad(set_to_none=False) an OffloadedEmbedding's weight holds zeros between steps;
    to_empty(device="cpu") made them uninitialised memory, the next backward added its gradient to it,
    and the step trained that memory into the table, silently (Adam, 15 steps: 51% of the table off)."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    expected = torch.from_numpy(table0.copy())  # the whole table in memory, plain SGD
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=16, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), emb)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    for _ in range(4):
        ids, weights = _zipf_batch(rng)
        (emb(ids) * weights).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert_to_empty_refused(model, "call optimizer.zero_grad")
        opt.zero_grad()
        model.to_empty(device="cpu")  # no gradient left: the working set is scratch
        _sgd_in_memory(expected, ids, weights)
        np.testing.assert_allclose(emb.table.to_numpy(copy=True), expected.numpy(), rtol=1e-6, atol=1e-6)


def test_switchers_refuse_to_empty_over_a_zeroed_gradient_and_after_zero_grad_train_on(rng):
    """After zero_grad(set_to_none=False) the switched nn.Embedding holds a zero gradient between steps;
    to_empty(device="cpu") made it uninitialised memory, and only the next backward was refused,
    telling to call the zero_grad() that had been called."""
    model, emb, opt, u, o = _switched_model(rng, torch.optim.SGD)
    expected = torch.from_numpy(u.getNumpyVersion().copy())  # the whole table in memory, plain SGD
    for _ in range(4):
        ids, weights = _zipf_batch(rng)
        o.before_forward(ids)
        (emb(u.before_forward(ids)) * weights).sum().backward()
        opt.step()
        u.after_step(ids)
        o.after_step(ids)
        opt.zero_grad(set_to_none=False)
        assert_to_empty_refused(model, "call optimizer.zero_grad")
        opt.zero_grad()
        model.to_empty(device="cpu")  # no gradient left: the switched embedding is scratch
        _sgd_in_memory(expected, ids, weights)
        np.testing.assert_allclose(u.getNumpyVersion(), expected.numpy(), rtol=1e-6, atol=1e-6)
