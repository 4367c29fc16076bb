"""SpeedTorch-style switchers: what every read of the tables shows in each window of a step.

A step of the switchers has these windows: after ``beforeForwardPass`` (on
both switchers), after the forward, after the backward, after
``optimizer.step()``, after the first ``afterOptimizerStep`` and after both.
In each, every public read of the rows and their optimizer state (the
switchers' own, and those of a table kept from between steps) is compared
with an in-memory reference (a plain ``nn.Embedding`` and torch optimizer
trained on the same fresh random data): a read returns what memory shows, or
is refused (``StateError``) where the tables hold a step's rows older than
memory's and the read cannot be completed with them.
"""

import h5py
import numpy as np
import pytest
import torch

import speedswap as ss

ROWS, DIM, CAPACITY, BATCH, STEPS = 80, 5, 40, 24, 6


def _zipf_ids(rng, device):
    p = 1.0 / np.arange(1, ROWS + 1) ** 1.1
    return torch.from_numpy(rng.permutation(ROWS)[rng.choice(ROWS, BATCH, p=p / p.sum())]).to(device)


def _begin_step(rng, device, switchers):
    """A step's fresh Zipf ids and output weights, its beforeForwardPass run on each of ``switchers``.

    Returns:
        ``(ids, weights, local)``: ``local`` the ids to feed the working set.
    """
    ids = _zipf_ids(rng, device)
    weights = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
    for switcher in switchers:
        local = switcher.beforeForwardPass(ids)
    return ids, weights, local


def _switched(backend, rng, cache_rows, stateful, max_norm=None):
    """A switched embedding of a fresh random table and the same table in memory.

    ``stateful``: Adagrad with a ModelFactory and an OptimizerFactory, against
    sparse-gradient Adagrad in memory (which offloaded Adagrad equals); else
    plain SGD with a ModelFactory alone (lazy SGD equals dense SGD).

    Returns:
        ``(device, emb, opt, u, o, reference, ref_opt)``; ``o`` is None for SGD.
    """
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = torch.nn.Embedding(CAPACITY, DIM, max_norm=max_norm).to(device)
    model = torch.nn.ModuleDict({"u": emb})
    make = torch.optim.Adagrad if stateful else torch.optim.SGD
    opt = make(model.parameters(), lr=0.3)
    u = ss.ModelFactory(emb, ROWS, DIM, CPUPinn=True, backend=backend, cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", CPUPinn=True, backend=backend,
                            cache_rows=cache_rows) if stateful else None
    reference = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0).to(device), freeze=False,
                                                   sparse=stateful, max_norm=max_norm)
    ref_opt = make(reference.parameters(), lr=0.3)
    return device, emb, opt, u, o, reference, ref_opt


def _load_npy(save, path):
    save(path)
    return np.load(path)


def _row_reads(u, kept, path):
    """``{name: call}`` of every read of the whole table that shares or reads its memory.

    Each call returns the rows as a numpy array (copied out of any view, which
    is dropped at once), ``path(name)`` giving a fresh file for the saves.
    """
    every = torch.arange(ROWS)
    return {
        "u.table.to_numpy(copy=True)": lambda: u.table.to_numpy(copy=True),
        "u.table.gather": lambda: u.table.gather(every).cpu().numpy(),
        "u.getTorchVar()": lambda: u.getTorchVar().cpu().numpy().copy(),
        "u.to_numpy()": lambda: u.to_numpy().copy(),
        "u.saveCupy": lambda: _load_npy(u.saveCupy, path("saveCupy.npy")),
        "u.saveTorch": lambda: torch.load(_saved_torch(u, path("saveTorch.pt"))).numpy(),
        "kept.gather": lambda: kept.gather(every).cpu().numpy(),
        "kept.to_numpy()": lambda: kept.to_numpy().copy(),
        "kept.to_numpy(copy=True)": lambda: kept.to_numpy(copy=True),
        "kept.as_tensor()": lambda: kept.as_tensor().cpu().numpy().copy(),
        "kept.host_chunks()": lambda: np.concatenate(list(kept.host_chunks())),
        "kept.save": lambda: _load_npy(kept.save, path("kept.npy")),
    }


def _saved_torch(u, file):
    u.saveTorch(file)
    return file


def _state_reads(o, kept, path):
    """``{name: call}`` of every read of the optimizer state table ``sum``, as :func:`_row_reads`."""
    every = torch.arange(ROWS)

    def saved():
        file = path("state.h5")
        o.save(file)
        with h5py.File(file, "r") as f:
            return f["sum"][:]
    return {
        "o.state.tables[sum].to_numpy(copy=True)": lambda: o.state.tables["sum"].to_numpy(copy=True),
        "o.state.tables[sum].gather": lambda: o.state.tables["sum"].gather(every).cpu().numpy(),
        "o.save": saved,
        "kept state.gather": lambda: kept.gather(every).cpu().numpy(),
        "kept state.to_numpy()": lambda: kept.to_numpy().copy(),
        "kept state.as_tensor()": lambda: kept.as_tensor().cpu().numpy().copy(),
        "kept state.save": lambda: _load_npy(kept.save, path("kept_state.npy")),
    }


def _check(reads, expected, current, when, refused_files, before="optimizer.step()"):
    """Each read returns ``expected`` when ``current``; else it raises StateError naming afterOptimizerStep
    and, as the read that would have worked, one ``before`` what made the tables fall behind."""
    for name, read in reads.items():
        if current:
            np.testing.assert_allclose(read(), expected, rtol=1e-5, atol=1e-6, err_msg=f"{name} {when}")
            continue
        with pytest.raises(ss.StateError, match="afterOptimizerStep") as refused:
            read()
        assert f"read before {before}" in str(refused.value), f"{name} {when}: {refused.value}"
    if not current:
        assert not [f for f in refused_files() if f.exists()], f"a refused save wrote a file {when}"


def _reads_against_memory(u, o, reference, ref_opt, tmp_path, stateful, copies):
    """``check(current, when)``: ``copies`` (reads that always show memory), and every read of the
    rows and (``stateful``) their state, against the in-memory reference (see :func:`_check`)."""
    kept, kept_state = u.table, (o.state.tables["sum"] if stateful else None)
    files = []

    def path(name):
        files.append(tmp_path / f"{len(files)}-{name}")
        return files[-1]

    def check(current, when):
        start = len(files)
        memory = reference.weight.detach().cpu().numpy().copy()
        _check(copies, memory, True, when, list)
        _check(_row_reads(u, kept, path), memory, current, when, lambda: files[start:])
        if stateful:
            state = ref_opt.state[reference.weight]["sum"].cpu().numpy().copy()
            _check(_state_reads(o, kept_state, path), state, current, when, lambda: files[start:])

    return check


@pytest.mark.parametrize("stateful", [True, False], ids=["Adagrad+OptimizerFactory", "SGD alone"])
@pytest.mark.parametrize("cache_rows", [0, 10])
def test_every_read_shows_memory_until_optimizer_step_and_again_after_after_step(
        backend, rng, tmp_path, cache_rows, stateful):
    """Reads between beforeForwardPass and optimizer.step() were refused, though the tables hold
    the step's rows and state as memory does there (not stepped yet; a cache's rows are written
    back first). Now they return what memory shows; from optimizer.step() until afterOptimizerStep
    they are refused but the copies (getNumpyVersion(), to_numpy(copy=True)), which add the step's
    rows; after the ModelFactory's afterOptimizerStep, alone or with the OptimizerFactory's, all
    read memory again."""
    device, emb, opt, u, o, reference, ref_opt = _switched(backend, rng, cache_rows, stateful)
    copies = {"u.getNumpyVersion()": u.getNumpyVersion, "u.to_numpy(copy=True)": lambda: u.to_numpy(copy=True)}
    check = _reads_against_memory(u, o, reference, ref_opt, tmp_path, stateful, copies)
    switchers = (u, o) if stateful else (u,)
    for step in range(STEPS):
        ids, weights, local = _begin_step(rng, device, switchers)
        check(True, f"after beforeForwardPass, step {step}")
        out, ref_out = emb(local), reference(ids)
        check(True, f"after the forward, step {step}")
        (out * weights).sum().backward()
        (ref_out * weights).sum().backward()
        check(True, f"after the backward, step {step}")
        opt.step()
        ref_opt.step()
        check(False, f"after optimizer.step(), step {step}")
        opt.zero_grad()
        ref_opt.zero_grad()
        check(False, f"after optimizer.zero_grad(), step {step}")
        # The ModelFactory's afterOptimizerStep writes the rows and their state back; the
        # OptimizerFactory's alone hands the state over to it and writes nothing.
        first = switchers[step % len(switchers)]
        first.afterOptimizerStep(ids)
        check(first is u, f"after {type(first).__name__}.afterOptimizerStep, step {step}")
        for switcher in switchers:
            if switcher is not first:
                switcher.afterOptimizerStep(ids)
        check(True, f"after afterOptimizerStep on both, step {step}")


@pytest.mark.parametrize("stateful", [True, False], ids=["Adagrad+OptimizerFactory", "SGD alone"])
@pytest.mark.parametrize("cache_rows", [0, 10])
def test_reads_inside_a_step_closure_show_memory_until_the_optimizer_changes_the_rows(
        backend, rng, tmp_path, cache_rows, stateful):
    """``optimizer.step(closure)`` with an LBFGS-style closure (zero_grad, forward, backward, the
    loss): a read of the tables inside the closure, before the optimizer changed any row, was
    refused as after optimizer.step() from the second step on, where the last step's gradient was
    still on the embedding when step() began (the first step, without one, read memory). The
    tables hold what memory does there; they fall behind once the closure returned."""
    device, emb, opt, u, o, reference, ref_opt = _switched(backend, rng, cache_rows, stateful)
    check = _reads_against_memory(u, o, reference, ref_opt, tmp_path, stateful,
                                  {"u.getNumpyVersion()": u.getNumpyVersion})
    switchers = (u, o) if stateful else (u,)
    for step in range(STEPS):
        ids, weights, local = _begin_step(rng, device, switchers)

        def closure():
            opt.zero_grad()
            loss = (emb(local) * weights).sum()
            loss.backward()
            check(True, f"inside the closure, step {step}")  # the reference has not stepped yet
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = (reference(ids) * weights).sum()
            loss.backward()
            return loss

        opt.step(closure)
        ref_opt.step(ref_closure)
        check(False, f"after optimizer.step(closure), step {step}")
        for switcher in switchers:
            switcher.afterOptimizerStep(ids)
        check(True, f"after afterOptimizerStep, step {step}")


@pytest.mark.parametrize("cache_rows", [0, 10])
def test_reads_after_a_forward_that_renormalised_the_rows_are_refused(backend, rng, tmp_path, cache_rows):
    """An nn.Embedding(max_norm=...) renormalises the rows its forward looks up, in place: in the
    working set, where memory renormalises the table's. From that forward the tables are behind
    memory as after optimizer.step(), and the reads that cannot add the step's rows are refused
    (the copies add them); without max_norm the same reads after a forward read memory (above)."""
    device, emb, opt, u, o, reference, ref_opt = _switched(backend, rng, cache_rows, True, max_norm=1.5)
    kept = u.table
    files = []

    def path(name):
        files.append(tmp_path / f"{len(files)}-{name}")
        return files[-1]

    for step in range(STEPS):
        ids, weights, local = _begin_step(rng, device, (u, o))
        memory = reference.weight.detach().cpu().numpy().copy()
        _check(_row_reads(u, kept, path), memory, True, f"after beforeForwardPass, step {step}", list)
        out, ref_out = emb(local), reference(ids)
        renormalised = reference.weight.detach().cpu().numpy().copy()
        assert np.abs(renormalised - memory).max() > 1e-3  # the forward changed rows in memory
        start = len(files)
        _check(_row_reads(u, kept, path), renormalised, False, f"after the forward, step {step}",
               lambda: files[start:], before="that write")
        np.testing.assert_allclose(u.getNumpyVersion(), renormalised, rtol=1e-5, atol=1e-6)
        (out * weights).sum().backward()
        (ref_out * weights).sum().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        u.afterOptimizerStep(ids)
        o.afterOptimizerStep(ids)
        _check(_row_reads(u, kept, path), reference.weight.detach().cpu().numpy(), True,
               f"after afterOptimizerStep, step {step}", list)


@pytest.mark.parametrize("cache_rows", [0, 10])
def test_writes_stay_refused_in_every_window_of_a_step(backend, rng, tmp_path, cache_rows):
    """A write into the tables between beforeForwardPass and afterOptimizerStep would be lost (the
    step's rows are written back over it) or train from rows the step did not gather: every write
    of the switchers and of tables kept from between steps is refused in each window, reads being
    let through before optimizer.step(), and nothing changes: training equals memory throughout."""
    device, emb, opt, u, o, reference, ref_opt = _switched(backend, rng, cache_rows, True)
    kept, kept_state = u.table, o.state.tables["sum"]
    u.saveCupy(tmp_path / "rows.npy")
    u.saveTorch(tmp_path / "rows.pt")
    o.save(tmp_path / "state.h5")
    kept_state.save(tmp_path / "sum.npy")
    one = torch.full((1, DIM), 0.25)
    writes = {
        "kept.scatter": lambda: kept.scatter([3], one),
        "kept.apply_": lambda: kept.apply_(torch.nn.init.zeros_),
        "kept.uniform_": lambda: kept.uniform_(-1, 1),
        "kept.load_from": lambda: kept.load_from(tmp_path / "rows.npy"),
        "u.zerosInit": u.zerosInit,
        "u.uniformDistributionInit": lambda: u.uniformDistributionInit(-1, 1),
        "u.normalDistributionInit": lambda: u.normalDistributionInit(0, 1),
        "u.customInit": lambda: u.customInit(torch.nn.init.zeros_),
        "u.loadCupy": lambda: u.loadCupy(tmp_path / "rows.npy"),
        "u.loadTorch": lambda: u.loadTorch(tmp_path / "rows.pt"),
        "kept state.scatter": lambda: kept_state.scatter([3], one),
        "kept state.load_from": lambda: kept_state.load_from(tmp_path / "sum.npy"),
        "o.optInit": o.optInit,
        "o.load": lambda: o.load(tmp_path / "state.h5"),
    }

    def check(when):
        for name, write in writes.items():
            with pytest.raises(ss.StateError,
                               match=r"between beforeForwardPass \(before_forward\) and afterOptimizerStep"):
                write()
        np.testing.assert_allclose(u.getNumpyVersion(), reference.weight.detach().cpu().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=when)

    for step in range(STEPS):
        ids, weights, local = _begin_step(rng, device, (u, o))
        check(f"after beforeForwardPass, step {step}")
        out, ref_out = emb(local), reference(ids)
        check(f"after the forward, step {step}")
        (out * weights).sum().backward()
        (ref_out * weights).sum().backward()
        check(f"after the backward, step {step}")
        opt.step()
        ref_opt.step()
        check(f"after optimizer.step(), step {step}")
        opt.zero_grad()
        ref_opt.zero_grad()
        first, second = (u, o) if step % 2 else (o, u)
        first.afterOptimizerStep(ids)
        check(f"after {type(first).__name__}.afterOptimizerStep, step {step}")
        second.afterOptimizerStep(ids)
    np.testing.assert_allclose(kept.to_numpy(copy=True), reference.weight.detach().cpu().numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kept_state.to_numpy(copy=True),
                               ref_opt.state[reference.weight]["sum"].cpu().numpy(), rtol=1e-5, atol=1e-6)



class _ClimbThenDescend(torch.optim.Optimizer):
    """SAM's update (Foret et al.) without optimizer state: ``step(closure)`` moves the rows up the
    gradient in place, calls the closure for the gradient there, then moves back and descends by it."""

    def __init__(self, params, lr, rho):
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure):
        climbs = [(p, group, group["rho"] * p.grad / p.grad.norm())
                  for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p, _, climb in climbs:
            p.add_(climb)
        with torch.enable_grad():
            loss = closure()
        for p, group, climb in climbs:
            p.sub_(climb).sub_(group["lr"] * p.grad)
        return loss


def _by_hand(emb, closure, read):
    """Plain SGD written out: the closure's gradient, an in-place update under no_grad, then ``read()``."""
    closure()
    with torch.no_grad():
        emb.weight.sub_(0.3 * emb.weight.grad)
    read()


def _sam(emb, closure, read):
    """A :class:`_ClimbThenDescend` step (stateless: a new one each step is the same), ``read()`` in its closure."""
    def read_then_closure():
        read()
        return closure()
    _ClimbThenDescend(emb.parameters(), lr=0.3, rho=0.05).step(read_then_closure)


@pytest.mark.parametrize("update, cause", [
    (_by_hand, "an update written by hand"),
    (_sam, "an optimizer.step(closure) that changed the rows before calling its closure")],
    ids=["update by hand", "step(closure) writing before its closure"])
def test_a_read_after_an_in_place_write_without_max_norm_is_refused_naming_what_wrote(
        backend, rng, update, cause):
    """Rows written in place between beforeForwardPass and afterOptimizerStep with no optimizer.step()
    seen yet (a hand-written update; SAM's step(closure), which climbs before its closure runs) leave
    the tables behind as max_norm's forward does, but the refusal blamed "such as the
    renormalisation of nn.Embedding(max_norm=...)'s forward" and said to read "before
    optimizer.step()", neither of which applies. Training still equals the same updates in memory."""
    device, emb, _, u, _, reference, _ = _switched(backend, rng, 0, False)
    for step in range(3):
        ids, weights, local = _begin_step(rng, device, (u,))
        reads = []

        def refused_read():
            with pytest.raises(ss.StateError, match="afterOptimizerStep") as refused:
                u.table.to_numpy(copy=True)
            reads.append(str(refused.value))

        for module, at, read in ((emb, local, refused_read), (reference, ids, lambda: None)):
            def closure(module=module, at=at):
                module.zero_grad()
                loss = (module(at) * weights).sum()
                loss.backward()
                return loss
            closure()  # the gradient SAM climbs along
            update(module, closure, read)
            module.zero_grad()
        assert len(reads) == 1
        assert cause in reads[0] and "max_norm" in reads[0], reads[0]  # either writer may have written
        assert "or read before that write" in reads[0] and "before optimizer.step()" not in reads[0], reads[0]
        u.afterOptimizerStep(ids)
        np.testing.assert_allclose(u.getNumpyVersion(), reference.weight.detach().cpu().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
