"""``examples/word2vec.py --distributed`` trains what one process trains, at any world size.

The ranks run the example itself (``tests/example_rank.py``: torchrun's variables,
a gloo group on this machine), on a corpus of 1,500 words, so that a
run wraps around the corpus and trains the short last batch of a pass. The
reference trains the same steps in memory with plain ``nn.Embedding`` tables.
"""

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rendezvous import rendezvous_url
from speedswap.apps.corpus import synthetic_corpus
from speedswap.apps.pairs import PairChunks
from speedswap.apps.skipgram import SkipGram
from speedswap.apps.word2vec import CHUNK_TOKENS

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "example_rank.py"
DEADLINE = 180  # seconds for the ranks of all the runs, against a hang (a collective that hangs ends at gloo's timeout)

#: About 2,600 pairs a pass, so 30 steps of 257 pairs make about three passes, each ending in a short batch.
VOCAB, TOPICS, TOKENS, DIM, NEGATIVES, WINDOW, SUBSAMPLE, LR, STEPS = 100, 4, 1500, 16, 5, 5, 1e-3, 0.025, 30
#: Not a multiple of 2 nor 3: the ranks' shares of a step differ by a pair.
BATCH = 257
TINY = ["--vocab", VOCAB, "--topics", TOPICS, "--tokens", TOKENS, "--dim", DIM, "--negatives", NEGATIVES,
        "--window", WINDOW, "--subsample", SUBSAMPLE, "--lr", LR, "--steps", STEPS, "--batch-size", BATCH]


def launch(world, out, args):
    """Start ``examples/word2vec.py ARGS`` on ``world`` ranks: the processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rendezvous = rendezvous_url(out)
    return [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), rendezvous, "word2vec",
                              *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for rank in range(world)]


def finish(runs):
    """Wait for every run's processes, killing all after :data:`DEADLINE`; fail if any failed."""
    deadline = time.monotonic() + DEADLINE
    try:
        outputs = [[proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for proc in procs]
                   for procs in runs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks still running after {DEADLINE} s: a collective hung")
    finally:
        for proc in (proc for procs in runs for proc in procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for procs, output in zip(runs, outputs):
        for rank, (proc, text) in enumerate(zip(procs, output)):
            assert proc.returncode == 0, f"rank {rank} of {len(procs)} failed:\n{text[-3000:]}"


def one_process_steps(seed):
    """The one-process run's first ``STEPS`` batches, ``(centres, contexts, negatives)`` each.

    Its pairs are ``PairChunks``' (one chunk a pass here), each chunk cut in
    order into batches of ``BATCH`` pairs, its last one shorter (``Chunk.batches``).
    """
    corpus = synthetic_corpus(VOCAB, TOPICS, TOKENS, seed=seed)
    chunks = PairChunks(corpus, window=WINDOW, negatives=NEGATIVES, subsample=SUBSAMPLE, chunk_tokens=CHUNK_TOKENS,
                        seed=seed)
    batches = (chunk.pairs(start, start + BATCH) for epoch in itertools.count() for chunk in chunks.epoch(epoch)
               for start in range(0, len(chunk.centres), BATCH))
    return list(itertools.islice(batches, STEPS))


def in_memory(steps, seed):
    """The centre vectors ``steps`` train in memory: nn.Embedding tables, plain SGD, word2vec's start.

    The start: centre vectors uniform in ``±0.5 / dim`` from a generator seeded
    with the seed, context vectors zero.
    """
    centre, context = torch.nn.Embedding(VOCAB, DIM), torch.nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        centre.weight.uniform_(-0.5 / DIM, 0.5 / DIM, generator=torch.Generator().manual_seed(seed))
        context.weight.zero_()
    model = SkipGram(centre, context)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in steps:
        optimizer.zero_grad()
        model(*batch).backward()
        optimizer.step()
    return centre.weight.detach().numpy()


def bytes_per_step(steps, world):
    """What ``world`` ranks send each other a step, on average over ``steps``, counted as the README counts.

    Rank ``r`` trains pairs ``[n * r // W, n * (r + 1) // W)`` of a step of ``n``;
    rows belong to ranks as ``torch.tensor_split`` cuts them. For each distinct
    row of a forward that another rank owns, a rank sends its id (8 bytes) and
    its gradient, and the owner sends the row (``4 * DIM`` bytes each).
    """
    owner = torch.cat([torch.full((len(rows),), rank) for rank, rows in
                       enumerate(torch.tensor_split(torch.arange(VOCAB), world))])
    sent = 0
    for centres, contexts, negatives in steps:
        n = len(centres)
        for rank in range(world):
            share = slice(n * rank // world, n * (rank + 1) // world)
            for ids in (centres[share], torch.cat([contexts[share, None], negatives[share]], dim=1)):
                sent += int((owner[ids.unique()] != rank).sum()) * (8 + 2 * 4 * DIM)
    return sent / len(steps)


@pytest.mark.slow
def test_distributed_word2vec_trains_the_one_process_vectors_at_any_world_size(tmp_path, seed):
    """Each rank drew its own negatives, seeded with ``--seed * 1000 + rank``, and read its own batches of
    ``--batch-size / W`` pairs: 1, 2 and 3 ranks trained three different models from one seed, none of them
    the one-process run's, and a batch size the world size did not divide was refused."""
    args = [*TINY, "--seed", seed, "--device", "cpu", "--quiet", "--distributed"]
    runs = {world: launch(world, tmp_path, [*args, "--save", tmp_path / f"{world}.npy",
                                            "--json", tmp_path / f"{world}.json"]) for world in (1, 2, 3)}
    one_process = subprocess.run([sys.executable, ROOT / "examples" / "word2vec.py", *map(str, TINY),
                                  "--seed", str(seed), "--device", "cpu", "--quiet", "--schedule", "constant",
                                  "--save", tmp_path / "one.npy"], cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                                 timeout=DEADLINE)
    assert one_process.returncode == 0, one_process.stdout + one_process.stderr
    finish(list(runs.values()))
    steps = one_process_steps(seed)
    assert any(len(centres) < BATCH for centres, *_ in steps)  # a pass's short last batch is among them
    expected = in_memory(steps, seed)
    start_table = torch.empty(VOCAB, DIM).uniform_(-0.5 / DIM, 0.5 / DIM,
                                                   generator=torch.Generator().manual_seed(seed)).numpy()
    assert np.abs(expected - start_table).max() > 0.1  # training moved the vectors: no run can pass untrained
    for name in ("1", "2", "3", "one"):
        # float32 rounding: each world size (and the one-process run's closed-form step) sums a step's
        # gradients in its own order.
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.npy"), expected, rtol=0,
                                   atol=1e-6 * np.abs(expected).max(),
                                   err_msg=f"{name} rank(s)" if name != "one" else "the one-process run")
    # What the ranks sent each other: the training steps' rows, not rank 0's gather of the table at the end.
    for world in (1, 2, 3):
        reported = json.loads((tmp_path / f"{world}.json").read_text())["bytes_sent_per_step"]
        assert reported == pytest.approx(bytes_per_step(steps, world), rel=1e-12), f"{world} rank(s)"
