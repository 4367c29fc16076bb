"""The examples' ``--distributed`` mode: tables row-sharded over the ranks torchrun starts.

Start one process per rank with torchrun (it sets the ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR`` variables :func:`init` reads)::

    torchrun --nproc-per-node 2 examples/word2vec.py --distributed

Each rank owns ``1/W`` of every table's rows and of their Adam state
(:class:`speedswap.ShardedOffloadedEmbedding`) and trains ``--batch-size / W``
of a step's examples, so one step covers what one process's step does. The
recommender reads its own share of every epoch (:class:`speedswap.BatchFeeder`
takes rank and world size from ``torch.distributed``). word2vec trains the
one-process run's steps at any world size: every rank makes all of that
run's pairs from ``--seed`` (this work is not split over the ranks), trains
a slice of each step's batch (:func:`_shares`) and draws the negatives of
its slice only, the ones that run draws for those pairs, so
``--distributed --steps N`` trains, on any number of ranks, the vectors
``examples/word2vec.py --steps N --schedule constant`` trains, to float32
rounding.
The ranks' gradients are averaged, as DDP averages them: the recommender's
loss is a mean, so the average is one process's gradient; word2vec's is a
sum over pairs (its ``--lr`` is per pair), so each rank's is multiplied by
``W`` first, and a step moves the rows as one process's step on all the
ranks' pairs would. The loss is reported per pair, over every rank's pairs,
as the one-process run reports it.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import speedswap as ss
from speedswap.apps import word2vec
from speedswap.apps.pairs import PairChunks


#: Optimizer steps when ``--steps`` is not given: the sharded run counts steps, not epochs.
STEPS = 300

#: Values of the centre table drawn at a time (see centre_rows).
CHUNK_VALUES = 1 << 20


def init(device):
    """Join the process group torchrun describes: NCCL for a GPU, gloo for the CPU.

    Returns:
        (rank, world_size)
    """
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def batch_per_rank(batch_size, world):
    """Each rank's share of ``--batch-size``, so that a step covers as many rows as one process's.

    Raises:
        OptionError: ``batch_size`` is not a multiple of ``world`` (rounding would
            silently train fewer, or more, rows a step than the one-process run).
    """
    if batch_size % world or batch_size < world:
        lower = max(world, batch_size - batch_size % world)
        raise ss.OptionError(f"--batch-size {batch_size} does not split evenly over {world} ranks: "
                             f"give a multiple of {world} (e.g. {lower} or {lower + world}), so that a "
                             f"step trains as many rows as one process does")
    return batch_size // world


def finish():
    """End a successful run on every rank: wait for the others, then exit without interpreter teardown.

    Left to the teardown, gloo's threads can abort the process ("terminate
    called without an active exception"; CI saw it twice, once after
    ``destroy_process_group`` had run at exit: pytorch issue 190489, and PR
    179291 on worker threads that still hold tensors when the interpreter
    goes). Every rank has written what it reports by now and the barrier
    means no collective is in flight, so ending the process here loses
    nothing. Call it only after a run that succeeded: it exits with status 0.
    """
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _shares(stream, batch_size, rank, world, corpus_tokens):
    """Endless (centres, contexts, negatives, pairs): this rank's share of each step the one-process run takes.

    ``stream`` gives the one-process run's chunks (:class:`PairChunks`: every
    pair drawn from ``--seed``), which every rank makes whole; each chunk is
    cut into batches of ``batch_size`` pairs (its last one shorter), as
    :func:`speedswap.apps.word2vec.train` cuts it, and rank ``r`` takes pairs
    ``[n * r // W, n * (r + 1) // W)`` of a batch of ``n``: slices that
    differ by at most one pair (none for some ranks in a batch of fewer
    pairs than ranks), and draws their negatives only
    (:meth:`~speedswap.apps.pairs.Chunk.pairs`: the ones one process draws
    for those pairs). So a step trains the same pairs with the same
    negatives at any world size, and each rank draws ``1/W`` of them. A
    chunk without pairs makes no step, as in one process.

    Args:
        stream: the chunks of :meth:`PairChunks.stream`, pass after pass.
        batch_size: ``--batch-size``: a step's pairs over all the ranks.
        rank, world: this rank, and the world size.
        corpus_tokens: the corpus's length (a pass's tokens).

    Yields:
        this rank's ``centres``, ``contexts`` and ``negatives`` of a step (CPU
        tensors), and ``pairs``, the step's pairs over all the ranks.

    Raises:
        OptionError: the first pass over the corpus made no pair (no document
            kept two words): the run would wait for ever.
    """
    read, paired = 0, False  # corpus tokens read; whether any chunk had pairs
    for chunk in stream:
        read, paired = read + chunk.tokens, paired or len(chunk.centres) > 0
        if not paired and read >= corpus_tokens:
            raise ss.OptionError(f"a pass over the corpus ({corpus_tokens:,} tokens) gave no skip-gram "
                                 f"pairs: no document kept two words (documents of one word, or "
                                 f"subsampling dropped the others); lower --subsample (0 keeps every "
                                 f"word) or give a corpus with longer documents")
        for start in range(0, len(chunk.centres), batch_size):
            pairs = min(batch_size, len(chunk.centres) - start)
            yield (*chunk.pairs(start + pairs * rank // world, start + pairs * (rank + 1) // world), pairs)


def centre_rows(table, rows, seed):
    """Fill ``table`` with the ``rows`` of the centre table the one-process run starts from.

    That run draws the whole table uniform in ``±0.5 / dim`` from a generator
    seeded with ``seed`` (``speedswap.apps.word2vec``); each rank draws the same
    values from the start, a chunk at a time, and keeps its own rows. The
    ranks so start from that table at any world size (with a seed per rank
    each world size started from another), holding one chunk besides their
    rows; a rank draws the values of every row before its last.

    Args:
        table: this rank's shard (``emb.table``), float32.
        rows: the rows it holds (``emb.row_range``).
        seed: ``--seed``.
    """
    dim = table.dim
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, CHUNK_VALUES // dim)

    def fill(shard):
        for first in range(0, rows.stop, chunk):
            end = min(first + chunk, rows.stop)
            drawn = torch.empty(end - first, dim).uniform_(-0.5 / dim, 0.5 / dim, generator=generator)
            if end > rows.start:
                start = max(first, rows.start)
                shard[start - rows.start:end - rows.start] = drawn[start - first:]
    table.apply_(fill)


def _skipgram(args, corpus, backend, per_rank):
    """The sharded tables, at word2vec's start as the one-process run draws it, and their optimizer.

    Returns:
        ``(centre, context, model, optimizer, lr)``
    """
    def table(name, max_rows):
        path = None if args.table_dir is None else f"{args.table_dir}/{name}"
        return ss.ShardedOffloadedEmbedding(corpus.vocab_size, args.dim, max_rows=max_rows,
                                            storage=args.storage, backend=backend, path=path)

    centre, context = table("centre", per_rank), table("context", per_rank * (args.negatives + 1))
    centre_rows(centre.table, centre.row_range, args.seed)
    context.table.zero_()
    model = word2vec.SkipGram(centre, context)
    optimizer_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
                     "adamax": torch.optim.Adamax}[args.optimizer]
    lr = word2vec.DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    centre.attach(optimizer)
    context.attach(optimizer)
    return centre, context, model, optimizer, lr


def word2vec_sharded(args, corpus, backend):
    """Train skip-gram vectors with both tables sharded over the ranks; rank 0 reports.

    Returns:
        ``(figures, centre vectors)`` on rank 0; ``(None, None)`` on the others.

    Raises:
        OptionError: a corpus without a document of two or more words, as the
            one-process run says it, on every rank before it joins the group
            or builds a table (an mmap run's files).
    """
    word2vec.check_gives_pairs(corpus)
    device = ss.get_backend(backend).device
    rank, world = init(device)
    chunks = PairChunks(corpus, window=args.window, negatives=args.negatives, subsample=args.subsample,
                        chunk_tokens=word2vec.CHUNK_TOKENS, seed=args.seed)
    steps = args.steps or STEPS
    # Started before the tables are built, as in one process, so that the first chunk is made
    # meanwhile; an endless stream, which the loop stops.
    with chunks.stream(1 << 30) as stream:
        # A rank's share of a step holds at most --batch-size / W pairs, rounded up.
        centre, context, model, optimizer, lr = _skipgram(args, corpus, backend, -(-args.batch_size // world))
        batches = _shares(stream, args.batch_size, rank, world, len(corpus.tokens))
        losses, pairs, start = [], 0, time.perf_counter()
        for step in range(steps):
            *ids, step_pairs = next(batches)
            loss = model(*(t.to(device) for t in ids))
            optimizer.zero_grad()
            # The rows' gradients are averaged over the ranks, as DDP averages; word2vec's loss sums its
            # pairs' (lr is per pair), so W times each rank's loss averages to the sum over all ranks' pairs.
            (loss * world).backward()
            optimizer.step()  # gradients reach the rows' owners, which step them
            pairs += step_pairs
            if step % 20 == 0 or step == steps - 1:
                # The loss is summed over a rank's pairs: the sum over every rank's, per pair.
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append((step, float(total) / step_pairs))
                word2vec.check_finite_loss(losses[-1], step_pairs, lr)  # the same sum on every rank: all stop
    seconds = time.perf_counter() - start

    # Each rank counts what it sent, so the sum is every rank's: read before the gather below, which
    # sends rank 0 the whole table once and is no step's traffic. On the device: NCCL reduces GPU tensors only.
    sent = torch.tensor([centre.bytes_sent + context.bytes_sent], dtype=torch.float64, device=device)
    dist.all_reduce(sent)
    # An eval forward is a collective too: rank 0 asks for every row, the others for none.
    with torch.no_grad():
        wanted = torch.arange(corpus.vocab_size if rank == 0 else 0, device=device)
        vectors = centre(wanted).cpu().numpy()
    if rank != 0:
        return None, None
    figures = {"world_size": world, "seconds": seconds, "losses": losses,
               "pairs_per_second": pairs / seconds,
               "bytes_sent_per_step": float(sent) / steps,
               "host_bytes_rank0": ss.info()["host_bytes"] + ss.info()["file_bytes"]}
    print(f"{world} ranks: {figures['pairs_per_second']:,.0f} pairs/s, loss per pair "
          f"{losses[0][1]:.3f} -> {losses[-1][1]:.3f}, "
          f"{figures['bytes_sent_per_step'] / 1024:.1f} KiB exchanged per step (all ranks)")
    if corpus.topics is not None:
        purity, line = word2vec.purity_report(vectors, corpus)
        figures.update(purity)
        print(f"topic purity {line}")
    return figures, vectors


def recommender_sharded(args, initial, mean, data, train, test, backend, fit, model_class, eps):
    """The recommender with its four tables row-sharded over the ranks; rank 0 reports.

    Every rank builds the same initial tables (same seed) and loads the rows
    it owns; ``BatchFeeder`` hands each rank its share of every epoch, and the
    sharded tables average the ranks' gradients as DDP does.

    Args:
        fit: the example's training loop; model_class, eps: its model and Adam's eps.

    Returns:
        ``(history, seconds, rank)``: the per-epoch RMSEs (computed on rank 0
        only; empty on the others), the training time and this rank.
    """
    device = ss.get_backend(backend).device
    rank, world = init(device)
    per_rank = batch_per_rank(args.batch_size, world)
    tables = []
    for values in initial:
        emb = ss.ShardedOffloadedEmbedding(values.shape[0], values.shape[1], max_rows=per_rank,
                                           storage=args.storage, backend=backend)
        rows = emb.row_range
        emb.table.apply_(lambda t, v=values[rows.start:rows.stop]: t.copy_(torch.from_numpy(v)))
        tables.append(emb)
    model = model_class(*tables, mean)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=eps)
    for emb in tables:
        emb.attach(optimizer)

    def whole_tables():
        # An eval forward is a collective: rank 0 asks for every row, the others for none.
        with torch.no_grad():
            return [emb(torch.arange(emb.num_embeddings if rank == 0 else 0, device=device))
                    .cpu().numpy() for emb in tables]

    args.batch_size = per_rank
    history, seconds = fit(model, optimizer, whole_tables, data, train, test, mean, args, device,
                           f"rank {rank}/{world}", score=rank == 0)
    return history, seconds, rank
