"""Validation and conversion of ids and values between numpy and torch.

Every public call that takes row ids or row values passes them through here
first, so a bad input is rejected before any row is touched. CuPy never
appears in this module: the cuda backend converts torch tensors itself.
"""

import functools
import warnings
from typing import Callable, Sequence, Union

import numpy as np
import torch

from .errors import DeviceError, DTypeError, IdError, OptionError, ShapeError

__all__ = ["int_option", "bool_option", "initialiser_option", "float_option", "check_rows", "check_dense",
           "check_has_values", "check_not_masked", "as_host_rows", "as_values_array", "as_host_array",
           "as_row_ids", "as_row_ids_deferred", "bounds_check", "read_bounds", "as_id_tensor", "check_id_range",
           "as_row_values", "torch_dtype", "numpy_dtype", "host_tensor", "numpy_view", "TABLE_DTYPES",
           "Ids", "Rows", "DTypeLike"]

#: Row ids as the public calls take them: a 1-D (or, for lookups, any-shape) torch tensor, numpy
#: array or sequence of ints (:func:`as_row_ids`).
Ids = Union[torch.Tensor, np.ndarray, Sequence[int]]
#: Row values: a tensor, array or nested sequence of one row per id (:func:`as_row_values`).
Rows = Union[torch.Tensor, np.ndarray, Sequence]
#: A dtype: a torch or numpy dtype, a numpy scalar type, or its name such as ``"float32"`` (:func:`torch_dtype`).
DTypeLike = Union[torch.dtype, np.dtype, type, str]


def int_option(value, name, *, minimum=1, hint=""):
    """``value`` as an int, if it is a whole number (Python or numpy, not bool) ``>= minimum``.

    The one check of every size, count, seed and index option speedswap takes.

    Args:
        value: the option's value.
        name: the option's name, for the message.
        minimum: the smallest allowed value.
        hint: appended to the message (what the option means).

    Returns:
        int

    Raises:
        OptionError: not an integer, or below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise OptionError(f"{name} must be {kind}, got {value!r}{hint}")
    return int(value)


def bool_option(value, name, *, hint=""):
    """``value`` as a bool, if it is one (Python's, or numpy's ``np.True_``), not merely truthy.

    Args:
        value: the option's value.
        name: the option's name, for the message.
        hint: inserted after "True" in the message (what True means).

    Returns:
        bool

    Raises:
        OptionError: anything else: ``bool("no")`` is True, and 1 may mean a count.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise OptionError(f"{name} must be True{hint} or False, got {value!r}")
    return bool(value)


def initialiser_option(fn, name) -> None:
    """Refuse an ``fn`` that cannot be called as an in-place initialiser ``fn(tensor, ...)``.

    Args:
        fn: the initialiser given.
        name: the argument's name, for the message.

    Raises:
        OptionError: ``fn`` is not callable (a value meant to fill the rows, say).
    """
    if not callable(fn):
        # Rows (a tensor, an array) are named by shape: their repr would fill the screen.
        got = (f"a {type(fn).__name__} of shape {tuple(fn.shape)}" if hasattr(fn, "shape")
               else f"{type(fn).__name__} {fn!r}")
        raise OptionError(f"{name} must be an in-place initialiser fn(tensor, ...) such as "
                          f"torch.nn.init.xavier_uniform_, got {got}; to fill every row with a "
                          f"value pass lambda t: t.fill_(value), to copy rows of the table's "
                          f"shape lambda t: t.copy_(torch.as_tensor(rows))")


def float_option(value, name) -> float:
    """``value`` as a float, if it is a finite real number (Python, numpy, or a 0-d tensor; not bool).

    The one check of every real-valued argument (initialiser bounds, means, deviations).

    Raises:
        DTypeError: not a real number.
        OptionError: NaN, infinite, or an int too large for a float.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise DTypeError(f"{name} must be a real number, got {value!r} of type "
                         f"{type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range (2**1024): as unusable as inf
        number = float("inf")
    if not np.isfinite(number):
        raise OptionError(f"{name} must be finite, got {value!r}")
    return number


_NUMPY_TO_TORCH = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
}
_TORCH_TO_NUMPY = {t: n for n, t in _NUMPY_TO_TORCH.items()}
#: torch's uint64 (new in torch 2.3), whose ids of 2**63 and more wrap around when cast to int64.
_TORCH_UINT64 = getattr(torch, "uint64", None)
#: numpy has no bfloat16: its rows are held as their 16-bit patterns and viewed by torch.
_BF16_BITS = np.dtype(np.uint16)
#: The names of the dtypes a table holds, as refusals list them.
TABLE_DTYPES = sorted([str(n) for n in _NUMPY_TO_TORCH] + ["bfloat16"])


def _unsupported(dtype):
    advice = ""
    if dtype in (np.dtype(np.uint64), _TORCH_UINT64):
        # Ids from hashes or a tokenizer often come as uint64: say how to keep them.
        advice = ("; uint64 ids convert with ids.astype(np.int64) (a tensor: ids.to(torch.int64)), "
                  "which keeps every id below 2**63, the largest an int64 row id holds")
    return DTypeError(f"dtype {dtype} is not supported; use one of {TABLE_DTYPES}{advice}")


#: Names numpy and torch read differently (torch.float is float32, np.dtype("float") float64).
_AMBIGUOUS = {"float": ("float64", "float32"), "int": ("int64", "int32")}


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype a numpy dtype, torch dtype, or name stands for.

    Args:
        dtype: ``"float32"``, ``"bfloat16"``, ``np.float16``, ``torch.bfloat16``, ...

    Returns:
        torch.dtype

    Raises:
        DTypeError: the dtype has no torch equivalent speedswap supports, or
            one numpy and torch read differently (``"float"``, ``"int"``, None).
    """
    if isinstance(dtype, torch.dtype):
        if dtype is not torch.bfloat16 and dtype not in _TORCH_TO_NUMPY:
            raise _unsupported(dtype)
        return dtype
    if isinstance(dtype, str):
        if dtype.startswith("torch."):  # "torch.float32", as str(torch.float32) prints it
            named = getattr(torch, dtype[len("torch."):], None)
            if not isinstance(named, torch.dtype):
                raise DTypeError(f"{dtype!r} is not a torch dtype; use e.g. 'float32'")
            return torch_dtype(named)
        if dtype in _AMBIGUOUS:
            raise DTypeError(f"dtype {dtype!r} is {_AMBIGUOUS[dtype][0]} in numpy but "
                             f"{_AMBIGUOUS[dtype][1]} in torch; name the one you mean")
        if dtype == "bfloat16":
            return torch.bfloat16
    if dtype is None:  # numpy reads it as float64, torch (nn.Embedding(dtype=None)) as its default dtype
        raise DTypeError(f"dtype None is float64 in numpy but torch's default dtype "
                         f"({torch.get_default_dtype()}) in torch; name the one you mean")
    try:
        npd = np.dtype(dtype)
    except TypeError as exc:
        raise DTypeError(f"{dtype!r} is not a dtype; use e.g. 'float32'") from exc
    if npd not in _NUMPY_TO_TORCH:
        if not npd.isnative:
            # ">f4" is float32 stored byte-swapped: "not supported, use float32" would mislead.
            raise DTypeError(f"dtype {npd.str!r} is {npd.newbyteorder('=')} in the other byte order "
                             f"(e.g. read from a big-endian file), which torch cannot view; "
                             f"convert it with a.astype(a.dtype.newbyteorder('='))")
        raise _unsupported(npd)
    return _NUMPY_TO_TORCH[npd]


def numpy_dtype(dtype) -> np.dtype:
    """The numpy dtype of a table's host memory for a numpy dtype, torch dtype, or name.

    bfloat16 rows are held as ``uint16`` bit patterns (numpy has no bfloat16);
    :func:`host_tensor` views them as ``torch.bfloat16``.

    Raises:
        DTypeError: the dtype has no equivalent speedswap supports.
    """
    dtype = torch_dtype(dtype)
    return _BF16_BITS if dtype is torch.bfloat16 else _TORCH_TO_NUMPY[dtype]


def _read_only(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(array)`` for data speedswap only reads (ids, values to write).

    torch warns that it cannot mark a tensor read-only when ``array`` is not
    writable (a read-only memmap, ``flags.writeable = False``); nothing here
    writes to it, so the warning would only alarm the caller.
    """
    if array.flags.writeable:  # the usual case: no warning to silence, no filter to install
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def host_tensor(array, dtype) -> torch.Tensor:
    """A torch view (no copy) of the host array ``array`` as a table of ``dtype``.

    Args:
        array: a numpy array whose dtype is ``numpy_dtype(dtype)``.
        dtype: the table's torch dtype.

    Returns:
        torch.Tensor sharing ``array``'s memory.
    """
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype is torch.bfloat16 else tensor


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, as a table's host memory holds it: :func:`host_tensor` reversed.

    numpy has no bfloat16: a bfloat16 tensor gives its ``uint16`` bit patterns
    (``numpy_dtype(torch.bfloat16)``), which numpy copies and assigns unchanged.

    Args:
        tensor: a CPU tensor that does not require grad (``.detach()`` one that does).

    Returns:
        numpy.ndarray sharing ``tensor``'s memory, whose ``writeable`` flag may be set
        (a copy's owner hands it out read-only or writable).
    """
    if tensor.dtype is torch.bfloat16:
        # Through int16, not torch.uint16, whose .numpy() not every supported torch has.
        return tensor.view(torch.int16).numpy().view(_BF16_BITS)
    # A view of .numpy()'s array: numpy refuses to set that array's own WRITEABLE flag to True.
    return tensor.numpy().view()


def check_rows(shape, what="the data") -> tuple:
    """The shape of one row of data shaped ``shape``, which needs rows along its first axis.

    Args:
        shape: the data's shape.
        what: how the data is named in messages.

    Returns:
        the row shape (``()`` for 1-D data such as labels).

    Raises:
        ShapeError: 0-d data, a negative dimension, no rows, or rows of no elements.
    """
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise ShapeError(f"{what} is 0-d; data needs at least one row along its first axis")
    if any(d < 0 for d in shape):
        raise ShapeError(f"{what} has shape {shape}: dimensions cannot be negative (numpy's -1 "
                         f"for 'infer' has nothing to infer from here); give every size")
    if shape[0] == 0 or 0 in shape[1:]:
        raise ShapeError(f"{what} has shape {shape}: no rows, or empty rows; data needs at "
                         f"least one row of at least one element")
    return shape[1:]


def check_not_masked(data, what="the data") -> None:
    """Raise :class:`DTypeError` for a numpy masked array.

    ``np.asarray`` (and a view as a plain array) drops the mask: the entries
    it hides, whatever bytes lie under them, would be read as values or ids.

    Raises:
        DTypeError: ``data`` is a ``numpy.ma.MaskedArray``.
    """
    if isinstance(data, np.ma.MaskedArray):
        raise DTypeError(f"{what} is a numpy masked array; its masked entries hold no values, and "
                         f"speedswap would read whatever lies under the mask: fill them first "
                         f"(a.filled(value)), or pass np.ma.getdata(a) if no entry is masked")


def as_host_array(data, what="the data") -> np.ndarray:
    """Host data as a numpy array sharing its memory: the one normaliser of datasets.

    Args:
        data: a numpy array (``np.memmap`` included), a CPU tensor, or anything
            ``np.asarray`` takes; shape ``(n, ...)``.
        what: how the data is named in messages.

    Returns:
        numpy.ndarray (a view where possible; a memmap stays a memmap).

    Raises:
        DeviceError: a tensor on a device (host data is expected).
        DTypeError: a dtype speedswap does not hold, a masked array, an
            object that holds no numbers (None, a dict), or a tensor with
            torch's lazy negation or conjugation bit (``z.conj().imag``).
        ShapeError: see :func:`check_rows`.
    """
    if isinstance(data, torch.Tensor):
        check_dense(data, what)
        if data.device.type != "cpu":
            raise DeviceError(f"{what} is a tensor on {data.device}; host data is expected here. "
                              f"Pass data.cpu(), or give device tensors to BatchFeeder directly")
        if data.is_neg() or data.is_conj():  # .numpy() raises a RuntimeError on them
            raise DTypeError(f"{what} is a lazily negated or conjugated view (such as z.conj().imag), whose "
                             f"memory holds other values than it shows, so it cannot be read in place; "
                             f"pass data.resolve_neg() (data.resolve_conj() for a complex one), which copies it")
        try:
            data = data.detach().numpy()
        except TypeError:  # bfloat16 and the like: numpy has no such dtype
            fed = (", or give the tensor to BatchFeeder directly, which feeds bfloat16 as it is"
                   if data.dtype == torch.bfloat16 else "")
            raise DTypeError(f"{what} is a tensor of {data.dtype}, which host data cannot be (numpy "
                             f"has no such dtype); convert it, e.g. data.float(){fed}") from None
    elif not isinstance(data, np.ndarray):  # np.asarray would turn a memmap into a plain array
        given = type(data).__name__
        try:
            data = np.asarray(data)
        except ValueError as exc:
            raise ShapeError(f"{what} is not rectangular ({exc})") from None
        if data.dtype == object:  # None, a dict, a DataGadget: held as Python objects, no numbers
            raise DTypeError(f"{what} is a {given}, not numbers; pass a numpy array, a CPU tensor or "
                             f"nested lists of numbers")
    check_not_masked(data, what)
    check_rows(data.shape, what)
    torch_dtype(data.dtype)
    return data


def check_dense(tensor, what) -> None:
    """Refuse a sparse, nested (or other non-strided) tensor, whose values no rows of memory hold.

    Args:
        tensor: a torch tensor handed in as ids, values or data.
        what: how it is named in the message.

    Raises:
        DTypeError: ``tensor`` is not an ordinary dense tensor.
    """
    if tensor.is_nested:  # a strided layout, but of parts of different shapes: torch raises on .shape
        raise DTypeError(f"{what} must be a dense tensor, got a nested one; join its parts with "
                         f"torch.cat(t.unbind()) or torch.stack(t.unbind()), or pad them with "
                         f"torch.nested.to_padded_tensor(t, padding)")
    if tensor.layout != torch.strided:
        raise DTypeError(f"{what} must be a dense tensor, got a {str(tensor.layout).replace('torch.', '')} "
                         f"one; convert it with .to_dense()")


def check_has_values(tensor, what) -> None:
    """Refuse a tensor whose values cannot be read as rows: a sparse or nested one, or one on the meta device.

    Raises:
        DTypeError: see :func:`check_dense`.
        DeviceError: a tensor on the meta device, which holds no values.
    """
    check_dense(tensor, what)
    if tensor.device.type == "meta":
        raise DeviceError(f"{what} is a tensor on the meta device, which holds no values; "
                          f"give a tensor with values (on the CPU or a GPU)")


def as_host_rows(array, what="the array") -> tuple:
    """Rows to copy into a table as a numpy array, and the (native byte order) dtype the table takes.

    The one reading of rows a table is built from (``HostTable.from_numpy``,
    ``OffloadedEmbedding.from_pretrained``): unlike :func:`as_host_array`,
    a tensor may be on a GPU and byte-swapped data is taken, since the rows
    are copied anyway (swapped as they are copied).

    Args:
        array: a numpy array, nested lists, or a torch tensor on any device.
        what: how the rows are named in messages.

    Returns:
        (numpy.ndarray, dtype): a bfloat16 tensor gives its ``uint16`` bit patterns (as a
        table's host memory holds them) and ``torch.bfloat16``; a byte-swapped
        (big-endian) array is returned as it is, with its dtype in the native
        byte order, for the caller to swap as it copies (a memmap of a
        big-endian file then needs no full-size native copy).

    Raises:
        ShapeError: nested lists of different lengths.
        DTypeError: a dtype a table cannot hold, a sparse or nested tensor, or a
            numpy masked array.
        DeviceError: a tensor on the meta device.
    """
    if isinstance(array, torch.Tensor):
        check_has_values(array, what)
        tensor = array.detach().cpu().resolve_neg()  # a lazy negation (z.conj().imag): .numpy() refuses it
        if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16: copy the bit patterns
            return numpy_view(tensor), torch.bfloat16
        torch_dtype(tensor.dtype)  # a DTypeError naming the dtypes a table holds, not numpy's TypeError
        array = tensor.numpy()
    else:
        check_not_masked(array, what)
        try:
            array = np.asarray(array)
        except ValueError:
            raise ShapeError(f"a table is 2-D (rows, dim), but {what} is nested lists of "
                             f"different lengths; give every row the same length") from None
    dtype = array.dtype.newbyteorder("=")  # big-endian data: the same numbers, which torch can view
    torch_dtype(dtype)  # objects, strings: no table holds them
    return array, dtype


def _device_readable(tensor_device, backend_device):
    """Whether a backend on ``backend_device`` can read a tensor on ``tensor_device``."""
    if tensor_device.type == "cpu":
        return True
    if backend_device.type != "cuda" or tensor_device.type != "cuda":
        return False
    return (tensor_device.index or 0) == (backend_device.index or 0)


def as_id_tensor(ids, device, *, to=None, what="ids", num_rows=None):
    """Convert ids to a flat, contiguous int64 tensor on ``device``, without the range check.

    For comparing ids with ids that were already validated (no host
    synchronisation on a GPU); use :func:`as_row_ids` for ids that index a table.

    Args:
        ids: a numpy array, list, int, or torch tensor of integer ids, any shape.
        device: the device the ids are for: tensors must be on the CPU or on it.
        to: where the result goes (default ``device``): the CPU for a table
            whose rows the CPU moves.
        what: how the ids are named in error messages.
        num_rows: the rows the ids index, named by the error of an id
            beyond int64; None when unknown.

    Returns:
        (flat_ids, shape): a contiguous 1-D ``torch.int64`` tensor on ``to``
        (never a strided or expanded view: kernels read it through a raw
        pointer) and the input's original shape.

    Raises:
        DTypeError: ids are not integers (floats, bools and quantized tensors are
            refused), a ragged list, a list or tuple of tensors, or a masked array.
        IdError: Python ints below -2**63 or from 2**63 on, which int64 cannot hold.
        DeviceError: ids live on a device the backend cannot read.
    """
    device = torch.device(device)
    target = device if to is None else torch.device(to)
    if isinstance(ids, torch.Tensor):
        check_dense(ids, what)
        if not _device_readable(ids.device, device):
            raise DeviceError(f"{what} are on {ids.device} but this table lives on "
                              f"{device}; move them with .to({str(device)!r})")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise _not_integers(what, f"a tensor of {ids.dtype}", ids.dtype == torch.bool, ".long()",
                                "mask.nonzero().flatten()")
        if ids.is_quantized:  # torch cannot convert one to int64: its integers are a scaled code
            raise DTypeError(f"{what} must be integers, got a quantized tensor of {ids.dtype}; convert "
                             f"it with .int_repr().long() for its stored integers, or "
                             f".dequantize().round().long() for the values it stands for")
        # Integer tensors never require grad, so there is nothing to detach; ids already
        # int64 on ``target`` (a training loop's every lookup) make no conversion op.
        flat = ids.reshape(-1)
        if flat.dtype != torch.int64:
            flat = flat.to(dtype=torch.int64)
        return _moved(flat.contiguous(), target), tuple(ids.shape)
    if isinstance(ids, (list, tuple)) and any(isinstance(i, torch.Tensor) and i.dim() for i in ids):
        # numpy would stack them under a new leading axis: `for batch in feeder` would look up ids
        # of shape (1, *batch), and emb(batch).mean(1) would average over examples, silently.
        raise DTypeError(f"{what} must be one tensor, array or list of ints, got a {type(ids).__name__} "
                         f"of {len(ids)} tensors (a BatchFeeder yields a tuple of batches, one per "
                         f"source: unpack it, for (batch,) in feeder); join several with torch.cat "
                         f"or torch.stack first")
    check_not_masked(ids, what)
    try:
        arr = np.asarray(ids)
    except ValueError:  # a ragged list
        raise DTypeError(f"{what} must be a rectangular array of integers, got nested lists of "
                         f"different lengths; pad them to one length or pass them separately") from None
    if arr.size == 0 and arr.dtype == np.float64:  # np.asarray([]) is float64
        arr = arr.astype(np.int64)
    if (not isinstance(ids, np.ndarray) and arr.dtype.kind == "i" and arr.size
            and any(_is_bool(i) for i in np.asarray(ids, dtype=object).flat)):
        # numpy reads [True, 2] as the ints 1 and 2: a mask mixed into ids, or a flag, not an id.
        raise DTypeError(f"{what} must be integers, got a list mixing bools with ints; a bool is no "
                         f"row id: pass the rows' ints (np.flatnonzero(mask) for the rows a mask selects)")
    if not isinstance(ids, np.ndarray) and arr.dtype.kind in "uf" and arr.size:
        # numpy reads a list of ints past int64 as uint64 (which wraps negative in int64), and
        # one mixing those with int64 ones as float64: read as Python objects, they are ints.
        as_objects = np.asarray(ids, dtype=object)
        if _all_ints(as_objects):
            arr = as_objects
    if arr.dtype == object and arr.size and _all_ints(arr):
        # numpy holds Python ints beyond int64 as objects: those are out of any table's range.
        beyond = [i for i in arr.flat if not -2**63 <= i < 2**63]
        if beyond:
            raise _beyond_int64(what, max(beyond, key=abs), num_rows)
        arr = arr.astype(np.int64)  # np.array([3, 7], dtype=object): ids like any others
    # kind, not np.issubdtype: numpy counts timedelta64 as an integer type.
    if arr.dtype.kind not in "iu":
        raise _not_integers(what, f"an array of {arr.dtype}", arr.dtype == bool, ".astype(np.int64)",
                            "np.flatnonzero(mask)")
    flat = _read_only(np.ascontiguousarray(arr.reshape(-1), dtype=np.int64))
    return _moved(flat, target), arr.shape


def _not_integers(what, got, mask, cast, selected) -> DTypeError:
    """The :class:`DTypeError` for ids that are not integers, with the conversion that fits them.

    Whole numbers held as floats are cast. Bools are a mask (SpeedTorch's CuPy arrays took one as an
    index): cast, True and False would be the ids 1 and 0, so the rows it selects are named instead.

    Args:
        what: how the ids are named.
        got: what they are, for the message (``"an array of bool"``).
        mask: whether they are bools.
        cast: the cast of whole numbers (``".long()"``).
        selected: the expression of the ids of the rows a mask selects.
    """
    if mask:
        return DTypeError(f"{what} must be integers, got {got}: a mask, not row ids; pass the ids of the "
                          f"rows it selects, {selected}")
    return DTypeError(f"{what} must be integers, got {got}; convert with {cast} if they are whole numbers")


def _beyond_int64(what, value, num_rows):
    """The :class:`IdError` for an id int64 cannot hold: no vocabulary size makes it a row."""
    rows, bound = ("any table", "the number of rows") if num_rows is None else (f"a table of {num_rows} rows",
                                                                                 num_rows)
    return IdError(f"{what} contain {value}, out of range for {rows}: beyond the int64 range of ids "
                   f"(ids must fit in int64 and lie in [0, {bound})); no row number is that far out: "
                   f"map keys or hashes to row numbers first")


def _is_bool(item) -> bool:
    """Whether a list's element is a bool: Python's, numpy's, or a 0-d bool tensor (numpy reads each as 0 or 1)."""
    return isinstance(item, (bool, np.bool_)) or (isinstance(item, torch.Tensor) and item.dtype == torch.bool)


def _all_ints(arr: np.ndarray) -> bool:
    """Whether every element of the object array ``arr`` is an int (Python or numpy), not a bool."""
    return all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) for i in arr.flat)


def _moved(flat, target):
    """``flat`` on ``target``; host ids cross to a GPU without making the host wait.

    A copy from pageable memory waits for the work queued on the stream (the
    previous step's backward and update); from page-locked memory it is
    queued behind it instead. The page-locked copy is also the caller's ids
    as they are now: changing the array afterwards cannot reach the transfer,
    and torch's pinned allocator keeps the block until the copy has run.
    """
    if flat.device.type == "cpu" and target.type == "cuda":
        # Always a copy: pin_memory() returns ids the caller already holds page-locked as they
        # are, and the transfer would read the caller's buffer whenever the stream reached it.
        staged = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        return staged.copy_(flat).to(target, non_blocking=True)
    return flat if flat.device == target else flat.to(target)


#: What the message of an id past the last row advises: an embedding's rows are its vocabulary.
VOCABULARY_ADVICE = "check the vocabulary size"
#: The same for a table or a dataset, whose rows are no vocabulary (:class:`~speedswap.HostTable`).
ROWS_ADVICE = "check the ids against the number of rows"


def check_id_range(flat, num_rows, *, what="ids", unsigned=False, advice=VOCABULARY_ADVICE):
    """Raise :class:`IdError` unless every id of ``flat`` lies in ``[0, num_rows)``.

    On a GPU tensor this is one host synchronisation (both bounds in one
    transfer), which is why speedswap checks each user call's ids once, here
    or, where a transfer is made anyway, in it (:func:`as_row_ids_deferred`).

    Args:
        flat: a 1-D integer tensor.
        num_rows: the table's row count.
        what: how the ids are named in error messages.
        unsigned: ``flat`` holds uint64 ids cast to int64, so a negative one
            stands for an id of ``2**63`` or more.
        advice: what the message of an id past the last row says to do
            (:data:`VOCABULARY_ADVICE` or :data:`ROWS_ADVICE`).
    """
    if flat.numel():
        _check_bounds(*read_bounds(flat), num_rows, what, unsigned, advice)


def read_bounds(flat) -> list:
    """The smallest and largest id of a non-empty ``flat``, both in one transfer (a host wait on a GPU).

    For a ``check_bounds`` (:func:`bounds_check`) whose caller has no read to put them in.
    """
    return torch.stack(torch.aminmax(flat)).tolist()


def as_row_ids(ids, num_rows, device, *, to=None, what="ids", advice=VOCABULARY_ADVICE):
    """Validate row ids and return them as a flat, contiguous int64 tensor on ``device``.

    The one check of a public call's ids (see :func:`check_id_range`); inner
    layers take its result as it is.

    Args:
        ids: a numpy array, list, int, or torch tensor of integer ids, any shape.
        num_rows: ids must lie in ``[0, num_rows)``.
        device, to: as in :func:`as_id_tensor`.
        what: how the ids are named in error messages.
        advice: as in :func:`check_id_range`.

    Returns:
        (flat_ids, shape), as :func:`as_id_tensor`.

    Raises:
        DTypeError: ids are not integers (floats and bools are refused).
        DeviceError: ids live on a device the backend cannot read.
        IdError: an id is negative or ``>= num_rows``.
    """
    flat, shape, check_bounds = as_row_ids_deferred(ids, num_rows, device, to=to, what=what, advice=advice)
    if check_bounds is not None and flat.numel():
        check_bounds(*read_bounds(flat))
    return flat, shape


def as_row_ids_deferred(ids, num_rows, device, *, to=None, what="ids", advice=VOCABULARY_ADVICE):
    """:func:`as_row_ids` for a caller that reads values of the ids back anyway: the range check goes with that read.

    Ids already where they are used (a GPU tensor for a GPU) are not
    range-checked here: on a GPU the check is a host wait of its own. The
    caller reads their smallest and largest values in a transfer it makes
    anyway and passes them to ``check_bounds`` before the ids reach a row.
    Host ids bound for a GPU are checked here, on the host, without a wait.

    Args:
        ids, num_rows, device, to, what, advice: as for :func:`as_row_ids`.

    Returns:
        (flat_ids, shape, check_bounds): ``check_bounds(lo, hi)`` raises
        :class:`IdError` unless ``[lo, hi]`` lies in ``[0, num_rows)``; None
        when the ids were checked here.

    Raises:
        DTypeError, DeviceError: as :func:`as_row_ids`; IdError for host ids.
    """
    device = torch.device(device)
    target = device if to is None else torch.device(to)
    unsigned = is_uint64(ids)
    if not (isinstance(ids, torch.Tensor) and ids.device.type != "cpu") and target.type != "cpu":
        # Host ids are checked on the host, then cross without a wait (see
        # _moved): no device synchronisation at all.
        flat, shape = as_id_tensor(ids, device, to="cpu", what=what, num_rows=num_rows)
        check_id_range(flat, num_rows, what=what, unsigned=unsigned, advice=advice)
        return _moved(flat, target), shape, None
    flat, shape = as_id_tensor(ids, device, to=target, what=what, num_rows=num_rows)
    return flat, shape, bounds_check(num_rows, what=what, unsigned=unsigned, advice=advice)


def is_uint64(ids) -> bool:
    """Whether ``ids`` are uint64 (a numpy array or torch tensor), whose values of 2**63 and more
    become negative int64s: a range check names them as given (``unsigned=``)."""
    dtype = getattr(ids, "dtype", None)
    if isinstance(ids, torch.Tensor):
        return dtype is _TORCH_UINT64
    return isinstance(dtype, np.dtype) and dtype == np.uint64


def bounds_check(num_rows: int, *, what: str = "ids", unsigned: bool = False,
                 advice: str = VOCABULARY_ADVICE) -> Callable[[int, int], None]:
    """``check_bounds(lo, hi)`` for ids whose smallest and largest values a caller reads anyway.

    Args:
        num_rows, what, unsigned, advice: as for :func:`check_id_range`.

    Returns:
        a function raising :class:`IdError` unless ``[lo, hi]`` lies in ``[0, num_rows)``.
    """
    return functools.partial(_check_bounds, num_rows=num_rows, what=what, unsigned=unsigned, advice=advice)


def _check_bounds(lo, hi, num_rows, what, unsigned, advice):
    if unsigned and lo < 0:
        raise _beyond_int64(what, lo + 2**64, num_rows)
    _check_range(lo, hi, num_rows, what, advice)


def _check_range(lo, hi, num_rows, what, advice):
    if lo < 0:
        raise IdError(f"{what} contain {lo}, but ids must be in [0, {num_rows}); "
                      f"negative ids are not wrapped around")
    if hi >= num_rows:
        raise IdError(f"{what} contain {hi}, out of range for a table of {num_rows} rows "
                      f"(ids must be in [0, {num_rows})); {advice}")


def as_values_array(values, shape, what="values") -> np.ndarray:
    """Values to write that are not a tensor (an array, nested lists) as a numpy array, mask and all refused.

    Args:
        values: anything ``np.asarray`` takes.
        shape: the shape the values must have, for the message.
        what: how the values are named in messages.

    Returns:
        numpy.ndarray (its shape and dtype are the caller's to check).

    Raises:
        DTypeError: a numpy masked array (``np.asarray`` would drop its mask).
        ShapeError: nested lists of different lengths.
    """
    check_not_masked(values, what)
    try:
        return np.asarray(values)
    except ValueError:  # nested lists of different lengths
        raise ShapeError(f"{what} must be a rectangular array of shape {tuple(shape)}, got nested "
                         f"lists of different lengths; give every row {shape[-1]} values") from None


def as_row_values(values, num_ids, dim, dtype, device, ids_shape=None, *, to=None):
    """Validate values for a scatter and return them as a tensor on ``device``.

    A tensor that requires grad (an ``nn.Parameter``, a result of a graph) is
    detached: its values are written, the graph is not kept.

    Args:
        values: a torch tensor or numpy array of shape ``(num_ids, dim)``, or
            ``(*ids_shape, dim)`` (a scalar id takes one row of shape ``(dim,)``).
        num_ids: the number of rows being written.
        dim: the table's row length.
        dtype: the table's torch dtype; values must have it exactly (no silent
            lossy cast).
        device: the device the values are for: tensors must be on the CPU or on it.
        ids_shape: the shape the ids were given in, when not 1-D.
        to: where the result goes (default ``device``).

    Returns:
        A contiguous tensor of shape ``(num_ids, dim)`` on ``to``, not requiring grad.

    Raises:
        DTypeError: values have another dtype, or are a sparse tensor or a masked array.
        ShapeError: values have another shape.
        DeviceError: values live on a device the backend cannot read.
    """
    device = torch.device(device)
    given = type(values)
    if not isinstance(values, torch.Tensor):
        arr = as_values_array(values, (num_ids, dim))
        if not arr.dtype.isnative:  # byte-swapped (a big-endian file): the same numbers, exactly
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if arr.dtype == object or arr.dtype not in _NUMPY_TO_TORCH:
            # numpy has no bfloat16: a table of it takes a tensor, bit patterns (to_numpy's) viewed as one.
            fix = ("pass a torch.bfloat16 tensor; uint16 bit patterns (as to_numpy() gives them) are "
                   "one as torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)"
                   if dtype is torch.bfloat16 else f"pass an array of the table's dtype, {dtype}")
            raise DTypeError(f"values of dtype {arr.dtype} cannot be written; {fix}")
        values = _read_only(np.ascontiguousarray(arr))
    check_dense(values, "values")  # a sparse tensor has no rows to copy (nor a reshape)
    values = values.detach()  # never let a table join an autograd graph
    if ids_shape is not None and tuple(values.shape) == (*ids_shape, dim):
        values = values.reshape(num_ids, dim)
    if not _device_readable(values.device, device):
        raise DeviceError(f"values are on {values.device} but this table lives on "
                          f"{device}; move them with .to({str(device)!r})")
    if values.dtype != dtype:
        # A numpy array has no .to() and a list no .astype(); numpy has no bfloat16 to cast to.
        cast = (f".to({dtype})" if issubclass(given, torch.Tensor)
                else f"torch.as_tensor(a).to({dtype})" if dtype is torch.bfloat16
                else f".astype('{_TORCH_TO_NUMPY[dtype]}')" if issubclass(given, np.ndarray)
                else f"np.asarray(values, dtype='{_TORCH_TO_NUMPY[dtype]}')")
        raise DTypeError(f"values have dtype {values.dtype} but the table holds {dtype}; "
                         f"cast them with {cast} first")
    if tuple(values.shape) != (num_ids, dim):
        wanted = f"({num_ids}, {dim})"
        if ids_shape is not None and tuple(ids_shape) != (num_ids,):
            wanted += f" or {(*ids_shape, dim)}"
        raise ShapeError(f"values have shape {tuple(values.shape)} but {num_ids} ids of a "
                         f"table with rows of {dim} need shape {wanted}")
    return values.to(device if to is None else to).contiguous()
