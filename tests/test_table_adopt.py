"""HostTable.adopt (sharing an existing array), read-only tables, and as_tensor."""

import warnings

import numpy as np
import pytest
import torch

import speedswap as ss


def random_rows(rng, shape, dtype=np.float32):
    return (rng.uniform(1.0, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(dtype)


def test_adopt_shares_the_array(backend, rng):
    array = random_rows(rng, (300, 7))
    table = ss.HostTable.adopt(array, backend=backend)
    assert table.storage == "pageable" and table.writable and table.shape == (300, 7)
    ids = rng.integers(0, 300, size=500)
    np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), array[ids])
    rows = rng.choice(300, size=20, replace=False)
    values = random_rows(rng, (20, 7))
    table.scatter(rows, torch.from_numpy(values))
    table.flush()
    np.testing.assert_array_equal(array[rows], values)  # written into the caller's array


#: How the memmap is handed to adopt: itself, or a plain view that is no np.memmap (np.asarray), whose
#: table was "pageable" and wrote nothing back at flush().
VIEWS = {"memmap": lambda array: array, "plain": np.asarray}


@pytest.mark.parametrize("view", VIEWS)
def test_adopt_memmap_writes_reach_the_file(backend, rng, tmp_path, view):
    path = tmp_path / "rows.npy"
    expected = random_rows(rng, (200, 5))
    np.save(path, expected)
    table = ss.HostTable.adopt(VIEWS[view](np.load(path, mmap_mode="r+")), backend=backend)
    assert table.storage == "mmap" and table.path == str(path)
    assert table.memory()["file"] == expected.nbytes and table.memory()["host"] == 0
    rows = np.array([3, 150, 7])
    values = random_rows(rng, (3, 5))
    table.scatter(rows, values)
    table.close()
    expected[rows] = values
    np.testing.assert_array_equal(np.load(path), expected)


@pytest.mark.parametrize("view", VIEWS)
def test_read_only_array_gives_a_read_only_table(rng, tmp_path, view):
    path = tmp_path / "rows.npy"
    expected = random_rows(rng, (100, 4))
    np.save(path, expected)
    mapped = VIEWS[view](np.load(path, mmap_mode="r"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "array is not writable" warning leaks out
        table = ss.HostTable.adopt(mapped, backend="numpy")
    assert not table.writable and table.path is None
    ids = rng.integers(0, 100, size=50)
    np.testing.assert_array_equal(table.gather(ids).numpy(), expected[ids])
    for write in (lambda: table.scatter([1], np.ones((1, 4), np.float32)),
                  lambda: table.uniform_(),
                  lambda: table.zero_(),
                  lambda: table.apply_(torch.nn.init.ones_),
                  lambda: table.load_from(path)):
        with pytest.raises(ss.StateError, match="read-only"):
            write()
    np.testing.assert_array_equal(np.load(path), expected)
    table.save(tmp_path / "copy.npy")  # reading still works, into another file
    np.testing.assert_array_equal(np.load(tmp_path / "copy.npy"), expected)
    # A writable tensor of the rows is a private copy-on-write map: a tensor over the read-only map
    # (a plain view's, until it was taken for the map it is) killed the process with SIGSEGV at a write.
    rows = table.as_tensor()
    rows[0] = 7.0
    assert float(rows[0, 0]) == 7.0
    np.testing.assert_array_equal(np.load(path), expected)
    np.testing.assert_array_equal(table.gather([0]).numpy(), expected[:1])


def test_as_tensor_shares_memory(backend, rng):
    array = random_rows(rng, (10, 3))
    table = ss.HostTable.from_numpy(array, storage="pageable", backend=backend)
    view = table.as_tensor()
    assert tuple(view.shape) == (10, 3)
    view[2] = 5.0
    assert table.to_numpy()[2].tolist() == [5.0, 5.0, 5.0]


@pytest.mark.parametrize("bad, error, match", [
    (np.ones(5, np.float32), ss.ShapeError, "2-D"),
    (np.ones((4, 6), np.float32)[:, ::2], ss.ShapeError, "C-contiguous"),
    ([[1.0, 2.0]], ss.DTypeError, "numpy array"),
    (np.ones((2, 2), np.complex64), ss.DTypeError, "not supported"),
    (np.ones((0, 3), np.float32), ss.OptionError, "num_rows"),
])
def test_adopt_refuses_bad_arrays(bad, error, match):
    with pytest.raises(error, match=match):
        ss.HostTable.adopt(bad, backend="numpy")


@pytest.mark.parametrize("part", ["rows 2:5", "an int32 view"])
def test_saving_part_of_a_mapped_file_over_that_file_is_refused_and_leaves_it_whole(part, tmp_path):
    """A save to the mapped file is a flush; for a slice or a reinterpretation that would leave the
    file holding something else than what was saved, silently (for a table and for a DataGadget)."""
    path = tmp_path / "data.npy"
    data = np.arange(20, dtype=np.float32).reshape(10, 2)
    np.save(path, data)
    whole = np.load(path, mmap_mode="r+")
    array = whole[2:5] if part == "rows 2:5" else whole.view(np.int32)
    for owner in (ss.HostTable.adopt(array, backend="numpy"), ss.DataGadget(array, backend="numpy")):
        with pytest.raises(ss.PathError, match="only part of it"):
            owner.save(path)
        np.testing.assert_array_equal(np.load(path), data)
    owner.save(tmp_path / "copy.npy")  # elsewhere it is a plain save
    np.testing.assert_array_equal(np.load(tmp_path / "copy.npy"), array)


def test_saving_a_whole_mapped_nd_file_over_itself_flushes_it(tmp_path):
    path = tmp_path / "data.npy"
    np.save(path, np.zeros((2, 3, 4), dtype=np.float32))
    mapped = np.load(path, mmap_mode="r+")
    gadget = ss.DataGadget(mapped, backend="numpy")
    mapped[1, 2, 3] = 7.0  # a write through the map the save must reach the file with
    gadget.save(path)
    assert np.load(path)[1, 2, 3] == 7.0 and np.load(path).shape == (2, 3, 4)
