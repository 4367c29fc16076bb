"""Bad inputs, as a table, against every public entry point: a clear error, and nothing changes.

Each row is (subject, call, expected exception family, message fragment). The
subject is built fresh with random data, its **full state** (table rows,
optimizer state tables, working set, module parameters and gradients,
optimizer state, files in the test directory) is snapshotted, the bad call
must raise a :class:`~speedswap.SpeedswapError` of the expected family whose
message holds the fragment (and never names a hidden temporary file), the
state must be bit-identical afterwards, and a valid call must still work.

Other engineers add rows for their entry points (the feeder) to ``CASES``.
"""

import errno
import gc
import hashlib
import os
import stat
import warnings

import h5py
import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.compat.steps import _STEPS
from speedswap.errors import MissingFileError, OutOfMemoryError, PathError

ROWS, DIM, CAP = 40, 4, 16


def _files(directory):
    """Every file under ``directory`` with a hash of its bytes."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = hashlib.sha1(f.read()).hexdigest()
    return found


def _tensors(obj):
    """Every tensor reachable in a (nested) dict/list, as numpy copies keyed by path."""
    out = {}

    def walk(value, key):
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu().clone().numpy()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")
        elif isinstance(value, (int, float, str, type(None))):
            out[key] = value
    walk(obj, "")
    return out


def _registry():
    """The table sizes of the live shared steps of switchers (earlier tests' garbage collected first)."""
    gc.collect()
    return sorted(r().num_rows for r in list(_STEPS.values()) if r() is not None)


class Subject:
    """An object under test, how to snapshot its whole state, and one valid call."""

    def __init__(self, obj, parts, valid):
        self.obj, self._parts, self._valid = obj, parts, valid

    def snapshot(self):
        return _tensors(self._parts())

    def valid(self):
        self._valid()


def _ids(rng, n=6):
    return torch.from_numpy(rng.integers(0, ROWS, size=n))


def table_subject(rng, tmp_path):
    table = ss.HostTable.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32),
                                    storage="pageable", backend="numpy")

    def valid():
        rows = table.gather([1, 2])
        table.scatter([3, 4], rows * 2)
        table.save(tmp_path / "ok.npy")
    return Subject(table, lambda: {"rows": table.as_tensor()}, valid)


def _embedding(rng, tmp_path, mid_step):
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="pageable", backend="numpy",
                                padding_idx=0)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(
        rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)
    emb(_ids(rng)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    if mid_step:
        emb(_ids(rng)).pow(2).sum().backward()

    def parts():
        return {"table": emb.table.as_tensor(), "working_set": emb._working_set.rows,
                "weight": emb.weight, "grad": emb.weight.grad,
                "state": {k: t.as_tensor() for k, t in emb._state.tables.items()},
                "optimizer": opt.state_dict(), "files": _files(tmp_path)}

    def valid():
        emb(_ids(rng)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        emb.save(tmp_path / "ok")
    return Subject(emb, parts, valid)


def embedding_subject(rng, tmp_path):
    return _embedding(rng, tmp_path, mid_step=False)


def mid_step_subject(rng, tmp_path):
    """An embedding after a training forward, before its optimizer step."""
    return _embedding(rng, tmp_path, mid_step=True)


def switchers_subject(rng, tmp_path):
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAP, DIM)})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    u = ss.ModelFactory(model["u"], ROWS, DIM, backend="numpy")
    u.uniformDistributionInit(-0.5, 0.5)
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend="numpy")

    def step():
        ids = _ids(rng)
        local = u.before_forward(ids)
        o.before_forward(ids)
        model["u"](local).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        u.after_step(ids)
        o.after_step(ids)
    step()

    def parts():
        return {"table": u.table.as_tensor(), "param": model["u"].weight,
                "state": {k: t.as_tensor() for k, t in o.state.tables.items()},
                "optimizer": opt.state_dict(), "files": _files(tmp_path),
                "registry": _registry()}
    return Subject((u, o), parts, step)


def gadget_subject(rng, tmp_path):
    gadget = ss.DataGadget(rng.standard_normal((ROWS, 2, 3), dtype=np.float32), backend="numpy",
                           storage="pinned")

    def valid():
        gadget.insertData(gadget.getData([1]) + 1, [2])
    return Subject(gadget, lambda: {"rows": torch.from_numpy(gadget.to_numpy(copy=True))}, valid)


def nothing_subject(rng, tmp_path):
    """For constructors: the state is the test directory's files and the switcher registry."""
    def parts():
        return {"files": _files(tmp_path), "registry": _registry()}

    def valid():
        ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, backend="numpy")
        ss.ModelFactory(torch.nn.Embedding(CAP, DIM), ROWS, DIM, backend="numpy")
    return Subject(None, parts, valid)


SUBJECTS = {"table": table_subject, "embedding": embedding_subject, "mid_step": mid_step_subject,
            "switchers": switchers_subject, "gadget": gadget_subject, "nothing": nothing_subject}


# ------------------------------------------------------------ bad files
def missing(d):
    return d / "missing.npy"


def a_directory(d, name="dir.npy"):
    (d / name).mkdir(exist_ok=True)
    return d / name


def h5_group(d):
    with h5py.File(d / "group.h5", "w") as f:
        f.create_group("table")
    return d / "group.h5"


def truncated_h5(d):
    ss.HostTable.zeros(ROWS, DIM, backend="numpy").save(d / "full.h5")
    data = (d / "full.h5").read_bytes()
    (d / "trunc.h5").write_bytes(data[:len(data) // 2])
    (d / "full.h5").unlink()
    return d / "trunc.h5"


def truncated_npy(d):
    np.save(d / "t.npy", np.ones((ROWS, DIM), np.float32))
    data = (d / "t.npy").read_bytes()
    (d / "t.npy").write_bytes(data[:-5])
    return d / "t.npy"


def other_shape(d):
    np.save(d / "other.npy", np.ones((ROWS + 1, DIM), np.float32))
    return d / "other.npy"


def one_value_per_row(d):
    """A 1-D file: one value per row, as np.save writes a bias vector."""
    np.save(d / "biases.npy", np.random.default_rng(5).standard_normal(ROWS).astype(np.float32))
    return d / "biases.npy"


def other_dtype(d):
    """A file of the table's shape in numpy's default float64: pretrained vectors saved as they came."""
    np.save(d / "float64.npy", np.random.default_rng(7).standard_normal((ROWS, DIM)))
    return d / "float64.npy"


def saved_with_suffix(d, suffix):
    """``d / "vectors"``, with the file ``vectors<suffix>`` saved beside it (then ``emb.load("vectors")``)."""
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, backend="numpy")
    emb.attach(torch.optim.Adam(emb.parameters()))
    emb.save(d / f"vectors{suffix}")
    emb.close()
    return d / "vectors"


def other_embedding_checkpoint(d, suffix=""):
    emb = ss.OffloadedEmbedding(ROWS + 1, DIM, max_rows=CAP, backend="numpy")
    emb.attach(torch.optim.Adam(emb.parameters()))
    emb.save(d / f"other{suffix}")
    return d / f"other{suffix}"


def a_foreign_directory(d):
    (d / "mine").mkdir(exist_ok=True)
    (d / "mine" / "notes.txt").write_text("keep")
    return d / "mine"


def a_file(d):
    (d / "notes.txt").write_text("keep")
    return d / "notes.txt"


def big_endian_npy(d):
    np.save(d / "big.npy", np.arange(10, dtype=">f4").reshape(5, 2))
    return d / "big.npy"


def existing_table_dir(d):
    (d / "tables").mkdir(exist_ok=True)
    np.save(d / "tables" / "table.npy", np.ones((ROWS, DIM), np.float32))
    return d / "tables"


def t(x):
    return torch.tensor(x)


def quantized(x):
    """Ids as a quantized tensor: integers to look at, but torch cannot convert it to int64."""
    with warnings.catch_warnings():  # torch 2.13 deprecates making quantized tensors; users still have them
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.tensor(x, dtype=torch.float32), 1.0, 0, torch.quint8)


class SignMomentum(torch.optim.Optimizer):
    """An optimizer of the user's own whose state is element-wise (Lion-like), unknown to speedswap."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    avg = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                    avg.mul_(0.9).add_(p.grad, alpha=0.1)
                    p.add_(avg.sign(), alpha=-group["lr"])


def nested(*parts):
    """A nested tensor of ``parts``: its layout is strided, but torch raises on its .shape and .reshape."""
    with warnings.catch_warnings():  # torch calls the strided layout of nested tensors a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.as_tensor(p) for p in parts])


def imaginary_of_conjugate(rows=ROWS):
    """Real float32 rows that torch holds negated, with its lazy negation bit: z.conj().imag."""
    return torch.randn(rows, DIM, dtype=torch.complex64).conj().imag


def optimizer_factory(optimizer=torch.optim.Adam, sparse=False, name="u", **kwargs):
    """An OptimizerFactory of ``optimizer`` over a fresh working-set embedding named ``name``, with ``kwargs``."""
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAP, DIM, sparse=sparse)})
    return ss.OptimizerFactory(optimizer(model.parameters()), ROWS, DIM, model, name, backend="numpy", **kwargs)


class SubclassedAdam(torch.optim.Adam):
    """Adam under another name: torch's own step, which raises at a sparse gradient."""


def inference_tensor(make, *args):
    """``make(*args)`` under ``torch.inference_mode()``: torch refuses in-place writes to it outside that mode."""
    with torch.inference_mode():
        return make(*args)


def nparams(emb):
    return emb.parameters()


# subject, call(obj, tmp_path), family, fragment
CASES = [
    # HostTable
    ("table", lambda o, d: o.gather([0, ROWS]), ss.IdError, "out of range"),
    ("table", lambda o, d: o.gather([-1]), ss.IdError, "negative"),
    ("table", lambda o, d: o.gather([1.5]), ss.DTypeError, "integers"),
    ("table", lambda o, d: o.gather(t([1, 2]).to_sparse()), ss.DTypeError, "dense tensor, got a sparse_coo"),
    ("table", lambda o, d: o.gather([[1, 2], [3]]), ss.DTypeError, "different lengths"),
    # Nested tensors are strided to .layout, and met torch's RuntimeError deep inside (reshape, .shape).
    ("table", lambda o, d: o.gather(nested([1, 2], [3])), ss.DTypeError, "got a nested one"),
    ("table", lambda o, d: o.scatter([1, 2], nested(torch.ones(DIM), torch.ones(DIM))), ss.DTypeError,
     "values must be a dense tensor, got a nested one"),
    ("table", lambda o, d: o.gather([1, 2], out=nested(torch.ones(DIM), torch.ones(DIM))), ss.DTypeError,
     "out must be a dense tensor, got a nested one"),
    ("embedding", lambda o, d: o(nested([1, 2], [3])), ss.DTypeError, "torch.cat(t.unbind())"),
    ("switchers", lambda o, d: o[0].before_forward(nested([1, 2], [3])), ss.DTypeError, "got a nested one"),
    ("gadget", lambda o, d: o.getData(nested([1, 2], [3])), ss.DTypeError, "got a nested one"),
    ("gadget", lambda o, d: o.insertData(nested(torch.ones(2, 3)), [1]), ss.DTypeError, "got a nested one"),
    ("gadget", lambda o, d: o.insertData(torch.ones(1, 2, 3).to_sparse(), [1]), ss.DTypeError, "got a sparse_coo one"),
    # The ids first, as HostTable.scatter takes them: the message only said to convert the ids
    # with .long(), which done to these values would write truncated ids as data, silently.
    ("gadget", lambda o, d: o.insertData([1, 2], torch.rand(2, 2, 3)), ss.DTypeError, "after the values"),
    ("gadget", lambda o, d: o.put(np.array([1, 2]), np.random.default_rng(3).random((2, 2, 3))),
     ss.DTypeError, "after the values"),
    ("nothing", lambda o, d: ss.BatchFeeder(nested([1.0, 2.0], [3.0]), batch_size=2, device="cpu"),
     ss.DTypeError, "source 0 must be a dense tensor, got a nested one"),
    ("nothing", lambda o, d: ss.BatchFeeder(torch.ones(4, 2).to_sparse().to("meta"), batch_size=2, device="cpu"),
     ss.DTypeError, "source 0 must be a dense tensor, got a sparse_coo one"),
    ("nothing", lambda o, d: ss.HostTable.from_numpy(nested(torch.ones(DIM), torch.ones(DIM)), backend="numpy"),
     ss.DTypeError, "the array must be a dense tensor, got a nested one"),
    ("nothing", lambda o, d: ss.HostTable.from_numpy(torch.ones(ROWS, DIM).to_sparse(), backend="numpy"),
     ss.DTypeError, "got a sparse_coo one"),
    # .numpy() raised torch's RuntimeError ("Can't call numpy() on Tensor that has negative bit set").
    ("nothing", lambda o, d: ss.BatchFeeder(imaginary_of_conjugate(), batch_size=2, device="cpu"),
     ss.DTypeError, "source 0 is a lazily negated or conjugated view"),
    ("nothing", lambda o, d: ss.DataGadget(imaginary_of_conjugate(), storage="pageable", backend="numpy"),
     ss.DTypeError, "resolve_neg()"),
    ("table", lambda o, d: o.gather(quantized([1, 2])), ss.DTypeError, "int_repr()"),
    ("table", lambda o, d: o.scatter([t([1, 2])], torch.ones(1, 2, DIM)), ss.DTypeError, "torch.cat"),
    ("table", lambda o, d: o.gather([1], out=torch.zeros(1, DIM, requires_grad=True)),
     ss.DTypeError, "requires grad"),
    ("table", lambda o, d: o.gather([1], out=torch.zeros(2, DIM)), ss.ShapeError, "out has shape"),
    # torch's "Inplace update to inference tensor outside InferenceMode is not allowed", raw.
    ("table", lambda o, d: o.gather([1], out=inference_tensor(torch.zeros, 1, DIM)), ss.DTypeError,
     "made under torch.inference_mode()"),
    ("table", lambda o, d: o.scatter([1, 1], torch.ones(2, DIM)), ss.DuplicateIdError, "repeat"),
    # check_unique=None skipped the check: repeated ids were written in whatever order, silently.
    ("table", lambda o, d: o.scatter([1, 1], torch.ones(2, DIM), check_unique=None), ss.OptionError,
     "check_unique must be True"),
    ("table", lambda o, d: o.scatter([1], torch.ones(1, DIM, dtype=torch.float64)),
     ss.DTypeError, "float64"),
    ("table", lambda o, d: o.scatter([1, 2], torch.ones(3, DIM)), ss.ShapeError, "shape"),
    ("table", lambda o, d: o.scatter([1, ROWS], torch.ones(2, DIM)), ss.IdError, "out of range"),
    # fn(tensor) raised Python's "'float' object is not callable"; customInit's after flushing the cache.
    ("table", lambda o, d: o.apply_(0.5), ss.OptionError, "fn must be an in-place initialiser"),
    ("switchers", lambda o, d: o[0].customInit(None), ss.OptionError, "initFunction must be an in-place"),
    # Rows to start from, given where the initialiser goes: the message printed the whole tensor
    # and offered fill_(value) only.
    ("switchers", lambda o, d: o[0].customInit(torch.ones(ROWS, DIM)), ss.OptionError,
     f"got a Tensor of shape ({ROWS}, {DIM}); to fill every row with a value pass lambda t: "
     f"t.fill_(value), to copy rows of the table's shape lambda t: t.copy_(torch.as_tensor(rows))"),
    ("table", lambda o, d: o.uniform_(1, 0), ss.OptionError, "low <= high"),
    ("table", lambda o, d: o.uniform_("a", 1), ss.DTypeError, "real number"),
    ("table", lambda o, d: o.normal_(0, -1), ss.OptionError, "std >= 0"),
    ("table", lambda o, d: o.normal_(float("nan")), ss.OptionError, "finite"),
    ("table", lambda o, d: o.normal_(0, float("inf")), ss.OptionError, "finite"),
    # An int past float's range is no more usable a bound than inf: float() raised OverflowError.
    ("table", lambda o, d: o.uniform_(0, 2**1024), ss.OptionError, "finite"),
    ("table", lambda o, d: o.load_from(missing(d)), MissingFileError, "missing.npy"),
    ("table", lambda o, d: o.load_from(a_directory(d)), PathError, "is a directory"),
    ("table", lambda o, d: o.load_from(h5_group(d)), ss.FileFormatError, "not a dataset"),
    ("table", lambda o, d: o.load_from(truncated_h5(d)), ss.FileFormatError, "truncated"),
    ("table", lambda o, d: o.load_from(truncated_npy(d)), ss.FileFormatError, "truncated"),
    ("table", lambda o, d: o.load_from(other_shape(d)), ss.FileFormatError, "of the file's shape"),
    # The hint was "load it into a table of the file's shape" for a file of the table's own shape.
    ("table", lambda o, d: o.load_from(other_dtype(d)), ss.FileFormatError, "astype(np.float32)"),
    ("table", lambda o, d: o.save(d / "nope" / "t.npy"), PathError, "does not exist"),
    ("table", lambda o, d: o.save(d / "t.pt"), ss.OptionError, "*.npy"),
    ("table", lambda o, d: o.save(a_directory(d)), PathError, "is a directory"),
    # OffloadedEmbedding between steps
    ("embedding", lambda o, d: o(t([1, ROWS])), ss.IdError, "out of range"),
    ("embedding", lambda o, d: o(t([1.0])), ss.DTypeError, "integers"),
    ("embedding", lambda o, d: o(t([[1, 0], [0, 2]]).to_sparse()), ss.DTypeError, "to_dense"),
    ("embedding", lambda o, d: o([[1, 2], [3]]), ss.DTypeError, "different lengths"),
    ("embedding", lambda o, d: o(quantized([1, 2])), ss.DTypeError, "quantized"),
    # What `for batch in feeder` hands over: a tuple of one batch per source. Read as one array
    # it gained a leading axis of 1, so emb(batch).mean(1) averaged over the batch, silently.
    ("embedding", lambda o, d: o(next(iter(ss.BatchFeeder(np.arange(8).reshape(4, 2), batch_size=2,
                                                          device="cpu")))),
     ss.DTypeError, "for (batch,) in feeder"),
    ("mid_step", lambda o, d: o((t([1, 2]), t([3, 4]))), ss.DTypeError, "a tuple of 2 tensors"),
    ("embedding", lambda o, d: o(t(list(range(CAP + 1)))), ss.CapacityError, "at most"),
    ("embedding", lambda o, d: o.load_state_dict(None), ss.DTypeError, "mapping"),
    ("embedding", lambda o, d: o.save(d / "emb.pt"), ss.OptionError, "no suffix"),
    ("embedding", lambda o, d: o.save(d / "nope" / "ckpt"), PathError, "does not exist"),
    ("embedding", lambda o, d: o.save(a_foreign_directory(d)), PathError, "not a speedswap"),
    ("embedding", lambda o, d: o.load(d / "missing"), MissingFileError, "missing'; check the path"),
    # A path with no suffix is a directory checkpoint: the file saved beside it went unmentioned.
    ("embedding", lambda o, d: o.load(saved_with_suffix(d, ".npy")), MissingFileError,
     "vectors.npy' is a file: load that path, suffix included"),
    # Named the checkpoint's inner file (other/v000001/table.npy) and advised HostTable.load, which
    # loads no checkpoint: an embedding of the saved shape is what loads it.
    ("embedding", lambda o, d: o.load(other_embedding_checkpoint(d)), ss.FileFormatError,
     f"other' holds a {ROWS + 1} x {DIM} table, but this one is {ROWS} x {DIM}; build the embedding "
     f"(or switchers) with {ROWS + 1} rows of {DIM}"),
    ("embedding", lambda o, d: o.load(other_embedding_checkpoint(d, ".h5")), ss.FileFormatError,
     f"other.h5' holds a {ROWS + 1} x {DIM} table, but this one is {ROWS} x {DIM}; build the embedding "
     f"(or switchers) with {ROWS + 1} rows of {DIM}"),
    ("embedding", lambda o, d: o.load(other_dtype(d)), ss.FileFormatError, "astype(np.float32)"),
    # Said only "a table needs 2-D (rows, dim)", not how a vector becomes one.
    ("embedding", lambda o, d: o.load(one_value_per_row(d)), ss.FileFormatError, "reshape(-1, 1)"),
    ("embedding", lambda o, d: o.load(truncated_h5(d)), ss.FileFormatError, "truncated"),
    ("embedding", lambda o, d: o.load(a_foreign_directory(d)), ss.FileFormatError,
     "not a speedswap"),
    # load_sharded read embedding._step_in_flight first: an AttributeError for anything else.
    ("embedding", lambda o, d: ss.load_sharded(d, ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=CAP,
                                                                                backend="numpy")),
     ss.DTypeError, "emb.load(path)"),
    ("embedding", lambda o, d: ss.load_sharded(d, o.table), ss.DTypeError, "into an OffloadedEmbedding, got a HostTable"),
    ("embedding", lambda o, d: o.attach(torch.optim.LBFGS(o.parameters())), ss.OptionError,
     "LBFGS"),
    # Its state is element-wise: the message said only state that is not was refused.
    ("embedding", lambda o, d: o.attach(SignMomentum(o.parameters())), ss.OptionError,
     "knows the state of these torch.optim optimizers"),
    ("embedding", lambda o, d: o.attach(torch.optim.Adam), ss.DTypeError, "Adam(model.parameters()"),
    ("embedding", lambda o, d: o.attach(o.parameters()), ss.DTypeError, "got a generator"),
    ("nothing", lambda o, d: ss.OptimizerFactory(torch.optim.SGD, ROWS, DIM, torch.nn.ModuleDict(
        {"u": torch.nn.Embedding(CAP, DIM)}), "u", backend="numpy"), ss.DTypeError, "the class SGD"),
    # OffloadedEmbedding after a forward, before the step
    ("mid_step", lambda o, d: o(t([ROWS + 3])), ss.IdError, "out of range"),
    ("mid_step", lambda o, d: o(t(list(range(CAP + 1)))), ss.CapacityError, "at most"),
    ("mid_step", lambda o, d: o.load(d / "missing"), ss.StateError, "between steps"),
    ("mid_step", lambda o, d: o.attach(torch.optim.SGD(o.parameters(), lr=1)), ss.StateError,
     "between steps"),
    # ModelFactory / OptimizerFactory
    ("switchers", lambda o, d: o[0].before_forward(t([1, ROWS])), ss.IdError, "out of range"),
    ("switchers", lambda o, d: o[1].before_forward(t([-2])), ss.IdError, "negative"),
    ("switchers", lambda o, d: o[0].before_forward(np.array([2**63 + 5], dtype=np.uint64)), ss.IdError,
     "contain 9223372036854775813, out of range"),
    ("switchers", lambda o, d: o[0].prefetch(np.array([1, 2**64 - 1], dtype=np.uint64)), ss.IdError,
     "contain 18446744073709551615"),
    ("switchers", lambda o, d: o[0].after_step(t([1])), ss.StateError, "before_forward"),
    ("switchers", lambda o, d: o[0].uniformDistributionInit(1, 0), ss.OptionError, "low <= high"),
    ("switchers", lambda o, d: o[0].normalDistributionInit(0, float("nan")), ss.OptionError,
     "finite"),
    ("switchers", lambda o, d: o[0].load(other_shape(d)), ss.FileFormatError, "shape"),
    ("switchers", lambda o, d: o[0].save(d / "nope" / "t.npy"), PathError, "does not exist"),
    ("switchers", lambda o, d: o[1].load(d / "missing"), MissingFileError, "no checkpoint"),
    ("switchers", lambda o, d: o[1].load(saved_with_suffix(d, ".h5")), MissingFileError,
     "vectors.h5' is a file: load that path, suffix included"),
    ("switchers", lambda o, d: o[1].save(d / "state.pt"), ss.OptionError, "no suffix"),
    # Paths: None, a file descriptor or a list raised os.fspath's raw TypeError, a NUL byte its ValueError.
    ("table", lambda o, d: o.save(None), ss.DTypeError, "path must be a str or an os.PathLike"),
    ("table", lambda o, d: o.load_from(3), ss.DTypeError, "got int 3"),
    ("table", lambda o, d: o.save(str(d / "t\0.npy")), PathError, "NUL byte"),
    ("embedding", lambda o, d: o.save(None), ss.DTypeError, "path must be a str"),
    ("embedding", lambda o, d: o.load([str(d / "ckpt")]), ss.DTypeError, "got list"),
    ("embedding", lambda o, d: o.save(str(d / "ck\0pt")), PathError, "NUL byte"),
    ("switchers", lambda o, d: o[0].saveTorch(None), ss.DTypeError, "path must be a str"),
    ("switchers", lambda o, d: o[1].load(3), ss.DTypeError, "path must be a str"),
    ("gadget", lambda o, d: o.save(None), ss.DTypeError, "path must be a str"),
    ("nothing", lambda o, d: ss.HostTable.load(None), ss.DTypeError, "path must be a str"),
    ("nothing", lambda o, d: ss.data.create_npy(str(d / "x\0.npy"), (2, 2), np.float32), PathError, "NUL byte"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="mmap", path=3, backend="numpy"),
     ss.DTypeError, "path must be a str"),
    ("nothing", lambda o, d: ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="mmap", path=[str(d)],
                                                          backend="numpy"), ss.DTypeError, "path must be a str"),
    ("nothing", lambda o, d: ss.ModelFactory(torch.nn.Embedding(CAP, DIM), ROWS, DIM, storage="mmap",
                                             path=str(d / "u\0.npy"), backend="numpy"), PathError, "NUL byte"),
    # DataGadget
    ("gadget", lambda o, d: o.getData([ROWS]), ss.IdError, "out of range"),
    # Made int64 before the range check: 'ids contain -1 ... negative ids are not wrapped around'.
    ("gadget", lambda o, d: o.getData(np.array([2**64 - 1], dtype=np.uint64)), ss.IdError,
     "indexes contain 18446744073709551615"),
    ("gadget", lambda o, d: o.getData([1], [ROWS + 2]), ss.IdError, f"negIndexes contain {ROWS + 2}"),
    ("gadget", lambda o, d: o.insertData(torch.ones(1, 2, 3, dtype=torch.float64), [1]),
     ss.DTypeError, "float64"),
    # put read values with np.asarray, which drops a mask: the masked entries' bytes were written.
    ("gadget", lambda o, d: o.insertData(np.ma.array(np.ones((1, 2, 3), np.float32), mask=np.eye(2, 3)), [1]),
     ss.DTypeError, "masked array"),
    ("gadget", lambda o, d: o.insertData([[[1.0] * 3, [1.0] * 2]], [1]), ss.ShapeError, "different lengths"),
    ("gadget", lambda o, d: o.insertData(torch.ones(3, 2, 3), [[1, 2], [3]]), ss.DTypeError, "different lengths"),
    ("gadget", lambda o, d: o.insertData(torch.ones(1, 2, 3), np.array([2**64 - 1], dtype=np.uint64)), ss.IdError,
     "contain 18446744073709551615"),
    # constructors
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, dtype=torch.int64),
     ss.DTypeError, "floating-point"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, padding_idx=1.5),
     ss.OptionError, "padding_idx"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, padding_idx=-1),
     ss.OptionError, f"pass padding_idx={ROWS - 1}"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=0), ss.OptionError,
     "max_rows"),
    # bool("False") is True: scale_grad_by_freq="False" scaled every gradient, overwrite="False"
    # replaced the file it named, and OptimizerFactory read overwrite=1 as a set of file names.
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, scale_grad_by_freq="False",
                                                   backend="numpy"), ss.OptionError, "scale_grad_by_freq must be True"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, sparse="no", backend="numpy"),
     ss.OptionError, "sparse must be True"),
    ("nothing", lambda o, d: ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=CAP, scale_grad_by_freq=1,
                                                          backend="numpy"), ss.OptionError, "scale_grad_by_freq"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="mmap", path=existing_table_dir(d),
                                                   overwrite="False", backend="numpy"), ss.OptionError, "overwrite must be True"),
    ("nothing", lambda o, d: ss.HostTable.zeros(ROWS, DIM, storage="mmap", path=existing_table_dir(d) / "table.npy",
                                                overwrite="False", backend="numpy"), ss.OptionError, "overwrite must be True"),
    ("nothing", lambda o, d: optimizer_factory(overwrite=1), ss.OptionError, "overwrite must be True"),
    # SpeedTorch's word2vec notebook builds nn.Embedding(sparse=True): torch's "Adam does not support
    # sparse gradients" came at the first optimizer.step(), in the middle of the switchers' step.
    ("nothing", lambda o, d: optimizer_factory(sparse=True), ss.OptionError, "Build it with sparse=False"),
    ("nothing", lambda o, d: optimizer_factory(SubclassedAdam, sparse=True, name="u.weight"), ss.OptionError,
     "and SubclassedAdam does not take the sparse gradient"),
    # torch's "add(sparse, dense) is not supported. Use add(dense, sparse) instead."
    ("nothing", lambda o, d: optimizer_factory(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
                                               sparse=True),
     ss.OptionError, "and SGD with weight_decay=0.01 does not take the sparse gradient"),
    # model.get_parameter on None: a raw AttributeError.
    ("nothing", lambda o, d: ss.OptimizerFactory(torch.optim.SGD(torch.nn.Embedding(CAP, DIM).parameters(), lr=1),
                                                 ROWS, DIM, None, "u", backend="numpy"),
     ss.DTypeError, "model must be the nn.Module holding the embedding"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="mmap",
                                                   path=existing_table_dir(d), backend="numpy"),
     PathError, "overwrite=True"),
    ("nothing", lambda o, d: ss.ModelFactory(torch.nn.Embedding(CAP, DIM), "many", DIM),
     ss.OptionError, "total_classes"),
    ("nothing", lambda o, d: ss.ModelFactory(torch.nn.Embedding(CAP, DIM), ROWS, DIM,
                                             storage="mmap", backend="numpy"),
     ss.OptionError, "path="),
    ("nothing", lambda o, d: ss.DataGadget(np.zeros((5, 0), np.float32), backend="numpy"),
     ss.ShapeError, "empty rows"),
    ("nothing", lambda o, d: ss.DataGadget(a_directory(d), backend="numpy"), PathError,
     "is a directory"),
    ("nothing", lambda o, d: ss.DataGadget(big_endian_npy(d), mmap=True, backend="numpy"),
     ss.DTypeError, "pass mmap=False to read it into memory"),
    ("nothing", lambda o, d: ss.BatchFeeder(torch.eye(4).to_sparse_csr(), batch_size=2, device="cpu"),
     ss.DTypeError, "source 0 must be a dense tensor, got a sparse_csr one"),
    ("nothing", lambda o, d: ss.BatchFeeder(np.arange(4, dtype=">u2"), batch_size=2, device="cpu"),
     ss.DTypeError, "other byte order"),
    ("nothing", lambda o, d: ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="mmap",
                                                   path=a_file(d), backend="numpy"),
     PathError, "is a file"),
    ("nothing", lambda o, d: ss.HostTable.load(a_directory(d, "d.h5")), PathError,
     "is a directory"),
    ("nothing", lambda o, d: ss.HostTable.empty(2**40, 1024, storage="pageable", backend="numpy"),
     OutOfMemoryError, "storage='mmap'"),
    # A device table of the numpy backend is host memory: the message spoke of GPU memory, said
    # nothing of the RAM available, and its advice (storage='pinned') fails as this one does.
    ("nothing", lambda o, d: ss.HostTable.empty(2**40, 1024, storage="device", backend="numpy"),
     OutOfMemoryError, "GiB of RAM is available now); use storage='mmap'"),
    # The hint said path='table.npy', which an embedding refuses: its path is a directory.
    ("nothing", lambda o, d: ss.OffloadedEmbedding(2**40, 1024, max_rows=CAP, storage="pageable",
                                                   backend="numpy"),
     OutOfMemoryError, "a directory for an OffloadedEmbedding"),
]


def _case_id(case):
    subject, call, family, fragment = case
    return f"{subject}-{family.__name__}-{fragment}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_raises_clearly_and_changes_nothing(case, rng, tmp_path):
    subject_name, call, family, fragment = case
    work = tmp_path / "work"
    work.mkdir()
    subject = SUBJECTS[subject_name](rng, work)
    inputs = tmp_path / "inputs"  # bad files are made here, outside the snapshot
    inputs.mkdir()
    before = subject.snapshot()
    with pytest.raises(family) as info:
        call(subject.obj, inputs)
    assert isinstance(info.value, ss.SpeedswapError), type(info.value).__mro__
    message = str(info.value)
    assert fragment in message, message
    assert ".tmp" not in message, message
    after = subject.snapshot()
    assert before.keys() == after.keys()
    for key in before:
        if isinstance(before[key], np.ndarray):
            np.testing.assert_array_equal(after[key], before[key], err_msg=key)
        else:
            assert after[key] == before[key], key
    subject.valid()


@pytest.mark.parametrize("make", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding],
                         ids=lambda make: make.__name__)
@pytest.mark.parametrize("path, named", [("e.npy", "e.npy"), ("e.H5", "e.H5"),
                                         (os.path.join("new", "e.hdf5", "deeper"), "e.hdf5")])
def test_an_mmap_path_named_like_a_file_is_refused_before_any_directory_is_made(make, path, named, tmp_path):
    """``path`` is a directory: ``path="e.npy"`` used to create a directory named ``e.npy``."""
    with pytest.raises(PathError) as info:
        make(ROWS, DIM, max_rows=CAP, storage="mmap", path=tmp_path / path, backend="numpy")
    message = str(info.value)
    assert f"would create a directory named {named!r}" in message, message
    assert "path is the directory" in message and f"{named.rsplit('.', 1)[0]!r} instead of {named!r}" in message
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_with_a_file_suffix_is_still_a_directory(tmp_path):
    """Only directories speedswap would create are judged by their name: one the user made is used."""
    (tmp_path / "tables.npy").mkdir()
    with ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="mmap", path=tmp_path / "tables.npy",
                               backend="numpy") as emb:
        assert emb.table.path == os.fspath(tmp_path / "tables.npy" / "table.npy")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("save", [
    lambda p, rows: ss.HostTable.from_numpy(rows, storage="pageable", backend="numpy").save(p),
    lambda p, rows: ss.DataGadget(rows, backend="numpy").save(p),
    lambda p, rows: ss.data.create_npy(p, rows.shape, rows.dtype),
    lambda p, rows: ss.data.create_npy(p, rows.shape, rows.dtype, lambda lo, hi: rows[lo:hi]),
], ids=["HostTable.save", "DataGadget.save", "create_npy", "create_npy-fill"])
def test_saving_over_a_named_pipe_is_refused_and_keeps_the_pipe(save, rng, tmp_path):
    """A save renames a new file over the path: a pipe, socket or device there (as root, /dev/null) was replaced by a regular file."""
    path = tmp_path / "out.npy"
    os.mkfifo(path)
    with pytest.raises(PathError, match="not a regular file") as info:
        save(path, rng.standard_normal((ROWS, DIM), dtype=np.float32))
    assert "out.npy" in str(info.value) and ".tmp" not in str(info.value)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert os.listdir(tmp_path) == ["out.npy"]


@pytest.mark.parametrize("rows, family, fragment", [
    # np.ascontiguousarray dropped the mask: the masked entries' bytes became trained rows.
    (np.ma.array(np.ones((ROWS, DIM), np.float32), mask=np.eye(ROWS, DIM)), ss.DTypeError, "masked array"),
    ([[1.0] * DIM, [1.0] * (DIM - 1)], ss.ShapeError, "embeddings is nested lists of different lengths"),
    (np.array([[1.0, None]] * 3), ss.DTypeError, "object is not supported"),
    (torch.ones(ROWS, DIM).to_sparse(), ss.DTypeError, "embeddings must be a dense tensor, got a sparse_coo"),
    (torch.ones(ROWS, DIM, device="meta"), ss.DeviceError, "embeddings is a tensor on the meta device"),
], ids=["masked", "ragged", "object", "sparse", "meta"])
def test_from_pretrained_refuses_rows_from_numpy_refuses_before_making_its_files(rows, family, fragment, tmp_path):
    with pytest.raises(family, match=fragment):
        ss.OffloadedEmbedding.from_pretrained(rows, max_rows=CAP, storage="mmap", path=tmp_path / "emb",
                                              backend="numpy")
    assert list(tmp_path.iterdir()) == []


def test_an_optimizer_with_a_step_of_its_own_over_a_sparse_embedding_is_not_refused():
    """Only torch's own steps are known to refuse a sparse gradient: a step of one's own may take it."""

    class OwnStep(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    optimizer_factory(OwnStep, sparse=True).close()
    optimizer_factory(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), sparse=True).close()


def int_rows_npy(d, rng):
    """The path of a ``.npy`` file of int64 rows (ids saved where vectors were meant)."""
    np.save(d / "ints.npy", rng.integers(0, 9, (ROWS, DIM)))
    return d / "ints.npy"


@pytest.mark.parametrize("make, dtype, fragment", [
    # Said "use torch.float32, ...", not how: from_pretrained took the rows' dtype.
    (lambda d, rng: torch.from_numpy(rng.integers(0, 9, (ROWS, DIM))), None,
     "rows are torch.int64, but an embedding trains floating-point rows; pass dtype=torch.float32"),
    (lambda d, rng: rng.integers(0, 2, (ROWS, DIM)).astype(bool), None, "rows are torch.bool"),
    (int_rows_npy, None, "convert the file first: np.save(path, np.load(path).astype(np.float32))"),
    # copy_ into the float32 table dropped the imaginary part, with only torch's ComplexWarning.
    (lambda d, rng: torch.complex(*torch.from_numpy(rng.standard_normal((2, ROWS, DIM), dtype=np.float32))),
     torch.float32, "dtype torch.complex64 is not supported"),
], ids=["int-tensor", "bool-array", "int-npy", "complex-tensor-to-float32"])
def test_from_pretrained_of_rows_not_floating_point_says_how_to_convert_before_making_files(make, dtype, fragment,
                                                                                          rng, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    rows = make(inputs, rng)
    given = {} if dtype is None else {"dtype": dtype}
    with pytest.raises(ss.DTypeError) as info:
        ss.OffloadedEmbedding.from_pretrained(rows, max_rows=CAP, storage="mmap", path=tmp_path / "emb",
                                              backend="numpy", **given)
    assert fragment in str(info.value), str(info.value)
    assert not (tmp_path / "emb").exists()


def test_from_pretrained_of_integer_rows_with_a_float_dtype_holds_their_values(rng):
    """What the refusal above says to do works: the rows are converted as they are read."""
    rows = rng.integers(-50, 50, (ROWS, DIM))
    for given in (rows, torch.from_numpy(rows)):
        emb = ss.OffloadedEmbedding.from_pretrained(given, max_rows=CAP, dtype=torch.float32, backend="numpy")
        np.testing.assert_array_equal(emb.table.to_numpy(), rows.astype(np.float32))
        emb.close()


@pytest.mark.parametrize("given", ["array", "npy file"])
def test_from_pretrained_without_max_rows_says_what_it_is_before_making_its_files(given, rng, tmp_path):
    """nn.Embedding.from_pretrained(rows) takes no max_rows, and the same call here raised Python's
    bare TypeError ("missing 1 required keyword-only argument"), where the constructor says what
    max_rows is and how to choose it."""
    rows = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    source = rows
    if given == "npy file":
        source = tmp_path / "rows.npy"
        np.save(source, rows)
    with pytest.raises(ss.OptionError, match="OffloadedEmbedding needs max_rows=: the most distinct rows"):
        ss.OffloadedEmbedding.from_pretrained(source, storage="mmap", path=tmp_path / "emb", backend="numpy")
    assert not (tmp_path / "emb").exists()
    with ss.OffloadedEmbedding.from_pretrained(source, max_rows=CAP, storage="mmap", path=tmp_path / "emb",
                                               backend="numpy") as emb:
        np.testing.assert_array_equal(emb.table.to_numpy(), rows)


@pytest.mark.parametrize("freeze", ["False", "no", 0])
def test_from_pretrained_refuses_a_freeze_that_is_not_a_bool_before_making_its_files(freeze, rng, tmp_path):
    """freeze="False" (read from a config file) is true to Python: the table was built and frozen,
    and training then read it without ever changing a row, silently."""
    rows = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    with pytest.raises(ss.OptionError, match=f"freeze must be True .* or False, got {freeze!r}"):
        ss.OffloadedEmbedding.from_pretrained(rows, freeze, max_rows=CAP, storage="mmap", path=tmp_path / "emb",
                                              backend="numpy")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("file_dtype, dtype, fragment", [
    (np.float64, torch.float32, "holds .* torch.float64, but this table is .* torch.float32"),
    (np.float32, torch.float16, "holds .* torch.float32, but this table is .* torch.float16"),
    (np.float32, torch.bfloat16, "not bfloat16 values"),  # found as the rows are read
])
def test_from_pretrained_of_a_mismatched_file_leaves_no_half_made_mmap_file(rng, tmp_path, file_dtype, dtype,
                                                                         fragment):
    """from_pretrained(path, dtype=...) of a file it refuses made the mmap table first: its
    table.npy stayed behind half made (rows never read), and the retry with the right file raised
    PathError ("already exists; speedswap does not replace a file it did not create")."""
    rows = rng.standard_normal((ROWS, DIM)).astype(file_dtype)
    np.save(tmp_path / "rows.npy", rows)
    with pytest.raises(ss.FileFormatError, match=fragment):
        ss.OffloadedEmbedding.from_pretrained(tmp_path / "rows.npy", max_rows=CAP, storage="mmap",
                                              path=tmp_path / "emb", backend="numpy", dtype=dtype)
    assert not (tmp_path / "emb" / "table.npy").exists()
    np.save(tmp_path / "rows.npy", rows.astype(np.float32))
    with ss.OffloadedEmbedding.from_pretrained(tmp_path / "rows.npy", max_rows=CAP, storage="mmap",
                                               path=tmp_path / "emb", backend="numpy") as emb:
        np.testing.assert_array_equal(emb.table.to_numpy(), rows.astype(np.float32))


def test_from_pretrained_refused_as_it_reads_leaves_another_file_put_under_its_table_s_name(
        rng, tmp_path, monkeypatch):
    """Its half-made table.npy is removed by its identity, not its name: a file moved there meanwhile stays."""
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    np.save(tmp_path / "rows.npy", rows)
    (tmp_path / "emb").mkdir()
    np.save(tmp_path / "theirs.npy", rng.standard_normal((ROWS, DIM), dtype=np.float32))
    theirs = (tmp_path / "theirs.npy").read_bytes()

    def moved_over_then_failing(table, path, header, dataset="table"):
        os.replace(tmp_path / "theirs.npy", tmp_path / "emb" / "table.npy")
        raise OSError(errno.EIO, "injected failure")

    monkeypatch.setattr(ss.files, "read_table", moved_over_then_failing)
    with pytest.raises(OSError, match="injected failure"):
        ss.OffloadedEmbedding.from_pretrained(tmp_path / "rows.npy", max_rows=CAP, storage="mmap",
                                              path=tmp_path / "emb", backend="numpy")
    assert (tmp_path / "emb" / "table.npy").read_bytes() == theirs


@pytest.mark.parametrize("name", ["rows.h5", "rows.hdf5"])
def test_from_pretrained_of_an_hdf5_file_says_it_reads_npy_and_what_reads_hdf5(rng, tmp_path, name):
    """from_pretrained(path) reads .npy files; an HDF5 file was refused as "not a valid .npy file
    (the magic string is not correct ...); write it with numpy.save", saying nothing of emb.load,
    which reads speedswap's HDF5 checkpoints. Nothing is made; emb.load of a saved one gives its rows."""
    rows = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    with ss.OffloadedEmbedding.from_pretrained(rows, max_rows=CAP, storage="pageable", backend="numpy") as saved:
        saved.save(tmp_path / name)
    with pytest.raises(ss.OptionError, match=r"reads a \.npy file.*emb\.load\(path\).*numpy\.save"):
        ss.OffloadedEmbedding.from_pretrained(tmp_path / name, max_rows=CAP, storage="mmap",
                                              path=tmp_path / "emb", backend="numpy")
    assert not (tmp_path / "emb").exists()
    with ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="pageable", backend="numpy") as emb:
        emb.load(tmp_path / name)
        np.testing.assert_array_equal(emb.table.to_numpy(), rows)


def test_from_pretrained_reads_byte_swapped_rows_exactly(rng):
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    with ss.OffloadedEmbedding.from_pretrained(rows.astype(">f4"), max_rows=CAP, storage="pageable",
                                               backend="numpy") as emb:
        assert emb.table.dtype == torch.float32
        np.testing.assert_array_equal(emb.table.to_numpy(), rows)


def test_from_numpy_copies_a_lazily_negated_tensor_as_the_values_it_shows(seed):
    """``z.conj().imag`` holds -imag in memory: from_numpy raised torch's RuntimeError from .numpy()."""
    rows = imaginary_of_conjugate()
    assert rows.is_neg()
    table = ss.HostTable.from_numpy(rows, storage="pageable", backend="numpy")
    assert torch.equal(table.as_tensor(), rows)


@pytest.mark.parametrize("sizes, named", [((2.5, 1), "batchSize"), ((True, 1), "batchSize"), (("4", 1), "batchSize"),
                                          ((4, None), "posPerBatch"), ((-1, 1), "batchSize"),
                                          ((4, 0), "posPerBatch"), ((4, 1, -1), "negPerBatch"),
                                          ((4, 1, 1.5), "negPerBatch")])
def test_variable_transformer_refuses_bad_sizes_and_keeps_its_placeholders(rng, sizes, named):
    """Non-int sizes raised Python's TypeError from np.arange; a negative one made empty placeholders
    silently, in place of the working ones."""
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAP, DIM)})
    u = ss.ModelFactory(model["u"], ROWS, DIM, backend="numpy")
    placeholder = u.variableTransformer(4, 1)
    with pytest.raises(ss.OptionError, match=f"{named} must be a positive int"):
        u.variableTransformer(*sizes)
    ids = _ids(rng, 4).reshape(4, 1)
    local = u.before_forward(ids)
    np.testing.assert_array_equal(placeholder, local.numpy())
    u.after_step(ids)


def test_overwrite_given_as_a_string_keeps_the_file(rng, tmp_path):
    """overwrite="False" is true to Python: the mmap table replaced the rows it was told to keep."""
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    np.save(tmp_path / "t.npy", rows)
    with pytest.raises(ss.OptionError, match="overwrite must be True .* or False, got 'False'"):
        ss.HostTable.empty(ROWS, DIM, storage="mmap", path=tmp_path / "t.npy", overwrite="False", backend="numpy")
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), rows)


def test_load_with_mmap_given_as_a_string_leaves_the_file_alone(rng, tmp_path):
    """mmap="False" is true to Python: the file itself became the table, and its scatters reached the disk."""
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    np.save(tmp_path / "t.npy", rows)
    with pytest.raises(ss.OptionError, match="mmap must be True .* or False, got 'False'"):
        table = ss.HostTable.load(tmp_path / "t.npy", storage="pageable", mmap="False", backend="numpy")
        table.scatter([0], np.zeros((1, DIM), np.float32))
        table.close()
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), rows)


def test_a_path_given_as_bytes_is_the_path_it_spells(rng, tmp_path):
    """os.fsencode(path) is a path to os: create_npy's save died matching it against a str pattern."""
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    ss.data.create_npy(os.fsencode(tmp_path / "x.npy"), rows.shape, rows.dtype, lambda lo, hi: rows[lo:hi])
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), rows)
    with ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="pageable", backend="numpy") as emb:
        emb.save(os.fsencode(tmp_path / "ckpt"))
        assert (tmp_path / "ckpt").is_dir()
    # DataGadget and from_pretrained took bytes for the data itself ("the dataset is 0-d", "dtype |S..").
    gadget = ss.DataGadget(os.fsencode(tmp_path / "x.npy"), backend="numpy")
    np.testing.assert_array_equal(gadget.getNumpyVersion(), rows)
    with ss.OffloadedEmbedding.from_pretrained(os.fsencode(tmp_path / "x.npy"), max_rows=CAP, storage="pageable",
                                               backend="numpy") as emb:
        np.testing.assert_array_equal(emb.table.to_numpy(), rows)


def test_from_pretrained_reads_a_byte_swapped_file_as_load_does(rng, tmp_path):
    """A '>f4' .npy got "dtype '>f4' ... convert it with a.astype(...)", though emb.load reads the same file."""
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    np.save(tmp_path / "big.npy", rows.astype(">f4"))
    with ss.OffloadedEmbedding.from_pretrained(tmp_path / "big.npy", max_rows=CAP, storage="pageable",
                                               backend="numpy") as emb:
        assert emb.table.dtype == torch.float32
        np.testing.assert_array_equal(emb.table.to_numpy(), rows)


def _zipf_ids(rng, n):
    return torch.from_numpy((rng.zipf(1.3, n) - 1) % ROWS)


@pytest.mark.parametrize("kind", ["OffloadedEmbedding", "ShardedOffloadedEmbedding"])
def test_a_closed_embedding_says_how_to_go_on_and_that_way_works(kind, backend, rng, tmp_path):
    """A call on a closed embedding said only "this OffloadedEmbedding is closed; its memory was released".

    The refusal now names the way on (build a new one, load what was saved), and that way gives
    back the rows and Adam state trained before close(): the next step equals the in-memory one.
    """
    make = getattr(ss, kind)
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    reference = torch.nn.Parameter(torch.from_numpy(rows.copy()))   # trained lazily: SparseAdam
    ref_opt = torch.optim.SparseAdam([reference], lr=0.05, eps=1e-30)
    emb = make(ROWS, DIM, max_rows=CAP, backend=backend)
    emb.table.scatter(np.arange(ROWS), rows)
    opt = torch.optim.Adam(emb.parameters(), lr=0.05, eps=1e-30)
    emb.attach(opt)
    device = emb.weight.device

    def step(embedding, optimizer, ids):
        embedding(ids.to(device)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.nn.functional.embedding(ids, reference, sparse=True).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()

    for _ in range(3):
        step(emb, opt, _zipf_ids(rng, 12))
    emb.save(tmp_path / "ckpt")
    steps = opt.state_dict()  # Adam's step count
    emb.close()
    with pytest.raises(ss.StateError, match=rf"{kind} is closed.* build a new {kind}.* load.* saved before close"):
        emb(_zipf_ids(rng, 4).to(device))

    again = make(ROWS, DIM, max_rows=CAP, backend=backend)
    opt = torch.optim.Adam(again.parameters(), lr=0.05, eps=1e-30)
    again.attach(opt)
    again.load(tmp_path / "ckpt")
    opt.load_state_dict(steps)
    step(again, opt, _zipf_ids(rng, 12))
    torch.testing.assert_close(again.table.as_tensor().cpu(), reference.detach())
    again.close()


def test_a_closed_table_says_how_to_read_its_rows_again_and_that_way_works(backend, rng, tmp_path):
    """``HostTable`` said "closed; its memory was released", also where an embedding's close() closed it."""
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, backend=backend)
    table = emb.table
    table.scatter(np.arange(ROWS), rows)
    table.save(tmp_path / "t.npy")
    emb.close()
    with pytest.raises(ss.StateError, match=r"HostTable is closed.* embedding or switcher.*HostTable\.load\(path\)"):
        table.gather([0])
    with ss.HostTable.load(tmp_path / "t.npy", backend=backend) as loaded:
        np.testing.assert_array_equal(loaded.to_numpy(), rows)
