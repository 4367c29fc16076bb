"""A process out of file descriptors: an ``mmap`` table it cannot make is refused clearly, and leaves no file.

An ``mmap`` table holds two descriptors while it lives (its map and one that
checks its file), so a recommender with hundreds of tables in files meets
``ulimit -n``. Before, the attach that met it raised numpy's bare ``OSError``
and left the state files it had made, and the retry after raising the limit
was refused: "already exists ... speedswap does not replace a file it did not
create". Each case runs in a subprocess, since the limit is the process's.
"""

import os
import subprocess
import sys
import textwrap

import pytest

_ATTACH_UNDER_LIMITS = textwrap.dedent("""
    import os, resource, sys
    import numpy as np, torch, speedswap as ss
    sys.path.insert(0, sys.argv[4])
    from mmap_training import BATCH, DIM, ROWS, step, zipf_ids
    directory, seed, again = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "again"
    rng = np.random.default_rng(seed)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH, storage="mmap", path=directory, backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb.table.to_numpy(copy=True)), freeze=False,
                                             sparse=True)
    def adam():
        return torch.optim.Adam(emb.parameters(), lr=0.01, eps=1e-30)  # SparseAdam adds eps elsewhere
    def train(opt, ref_opt, steps):
        for _ in range(steps):
            step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng),
                 weights=torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)))
    if again:  # an attach that replaces the files of the optimizer attached before
        emb.attach(first := adam())
        train(first, torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-30), 10)
        emb.flush()
        before = sorted(os.listdir(directory))
    else:
        before = ["table.npy"]
    opt = adam()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    for spare in range(-4, 64):  # one more descriptor each time, until the attach has enough (an attach
        # again keeps the old state's four open until the new state has its own)
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + spare, hard))
        try:
            emb.attach(opt, restart=again)
            refused = None
        except ss.PathError as exc:
            refused = exc
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if refused is None:
            break
        assert "ulimit -n" in str(refused), refused
        assert sorted(os.listdir(directory)) == before, os.listdir(directory)  # no temporary either
        assert not opt.state
        print("refused", flush=True)
    print("attached", sorted(os.listdir(directory)), flush=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-30)
    train(opt, ref_opt, 30)
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    ref_state = ref_opt.state[ref.weight]
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_allclose(emb._state.tables[name].to_numpy(), ref_state[name].to_dense().numpy(),
                                   rtol=1e-4, atol=1e-6)
    emb.close()
    print("trained as in memory", flush=True)
""")


@pytest.mark.parametrize("attach", ["first", "again"])
def test_an_attach_out_of_descriptors_is_refused_leaves_no_state_file_and_a_retry_trains_as_in_memory(
        tmp_path, seed, attach):
    """``again``: a new optimizer's attach (``restart=True``), whose state files replace the old ones'."""
    done = subprocess.run([sys.executable, "-c", _ATTACH_UNDER_LIMITS, str(tmp_path / "emb"), str(seed), attach,
                           os.path.dirname(__file__)], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # A limit at what is open refuses the first of Adam's two state tables; one that lets it through
    # refuses the second (its temporary, its directory, its map or the descriptor that checks it); then
    # the attach has enough.
    assert lines.count("refused") >= 2, done.stdout
    assert lines[-2] == "attached ['exp_avg.npy', 'exp_avg_sq.npy', 'table.npy']", done.stdout
    assert lines[-1] == "trained as in memory"
