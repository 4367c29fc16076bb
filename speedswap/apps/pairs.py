"""Skip-gram training examples made ahead of the training loop: pairs, their negatives, planned batches.

A background thread turns the corpus, one chunk of tokens at a time, into
shuffled (centre, context) arrays (subsampling, dynamic window); a second one
cuts each chunk into batches, draws their unigram^0.75 negatives and plans
them (:class:`PairBatch`: ids checked, pairs sorted by centre, context ids
grouped), the bookkeeping of the closed-form training step, while the
training loop trains the batches planned before. numpy's and torch's
kernels release the GIL, so on a CPU with two cores the pairs and the plans
cost little of the training thread's time.

>>> from speedswap.apps.corpus import synthetic_corpus
>>> corpus = synthetic_corpus(vocab=200, topics=4, tokens=5_000, seed=0)
>>> chunks = PairChunks(corpus, window=5, negatives=5, subsample=1e-3, chunk_tokens=2_000, seed=0)
>>> sum(chunk.tokens for chunk in chunks.epoch(0))
5000
>>> with chunks.batches(1, batch_size=256) as batches:
...     batch = next(batches)
>>> len(batch), batch.ids.shape[1], bool((batch.centres[1:] >= batch.centres[:-1]).all())
(256, 6, True)
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

import speedswap as ss
from speedswap import convert

from .corpus import Corpus, keep_probabilities, skipgram_pairs

__all__ = ["NegativeSampler", "PairBatch", "Chunk", "PairChunks", "Background"]


class NegativeSampler:
    """Draws negative words from the unigram distribution raised to ``power`` (0.75).

    Sampling is an inverse-CDF lookup, so it needs no multi-hundred-megabyte
    table for large vocabularies and never draws a word that does not occur.
    The lookup is a guide table (Chen and Asau's indexed search): the uniform
    draw's bucket among ``2**k`` equal buckets of ``[0, 1)`` gives the first
    word whose CDF reaches the bucket's start, and at most a couple of
    compares finish the search. It returns exactly what ``torch.searchsorted``
    on the CDF returns, about 2.7 times faster on a CPU (its binary search
    was most of the time spent making the training examples). Vocabularies whose tail is too
    dense for a guide table of at most ``2**22`` buckets use the binary search.

    The uniform numbers come from streams of a counter-based generator
    (numpy's ``Philox``), one per ``(seed, *stream)``, in which any draw can
    be reached directly by its position: the draws of a slice of pairs are
    the same whoever draws them and however the pairs are cut, and cost
    that slice's draws only (a rank of a sharded run draws its own pairs'
    negatives, and they are the ones one process draws for those pairs).
    """

    #: The most compares a guide-table lookup may need before binary search is cheaper.
    _MAX_STEPS = 4
    #: Draws per pass: 1 MiB of them keeps each temporary at 8 MiB.
    SLICE = 1 << 20

    def __init__(self, counts: Sequence[int], device: torch.device, power: float = 0.75, seed: int = 0):
        weight = np.asarray(counts, dtype=np.float64) ** power
        # Divided by its own last value, the CDF ends at exactly 1.0, above every uniform number.
        cdf = np.cumsum(weight)
        cdf /= cdf[-1]
        self._cdf = torch.from_numpy(cdf).to(device)
        self._seed = seed
        self._last = len(cdf) - 1
        self._buckets, self._guide, self._steps = 0, None, 0
        # Buckets are a power of two, so u * buckets is exact and floor(u * buckets) / buckets <= u;
        # four per word to start with, at most 2**22 (a 32 MiB table).
        buckets = 1 << min(max(int(4 * len(cdf) - 1).bit_length(), 10), 22)
        while True:
            guide = np.searchsorted(cdf, np.arange(buckets + 1, dtype=np.float64) / buckets, side="right")
            steps = int(np.diff(guide).max())
            if steps <= 2 or buckets >= 1 << 22:
                break
            buckets *= 2
        if steps <= self._MAX_STEPS:
            self._buckets, self._steps = buckets, steps
            self._guide = torch.from_numpy(guide[:-1]).to(device)

    def __call__(self, shape: Sequence[int], *, stream: Sequence[int] = (), first: int = 0) -> torch.Tensor:
        """Negative word ids of ``shape`` (int64, on the sampler's device): draws ``first, first + 1, ...`` of a stream.

        The draws fill the result in row-major order, so row ``i`` of a
        ``(P, K)`` draw from ``first=s * K`` holds draws ``(s + i) * K ...``:
        the negatives of pair ``s + i`` of the stream, as a draw of all its
        pairs from ``first=0`` holds them.

        They are drawn :data:`SLICE` at a time into the result: the same draws
        as one pass, but the temporaries stay a few MiB, in the CPU's caches
        and reused by the allocator, where a chunk's worth (tens of millions
        of draws) made each of the six passes a trip to memory and every new
        page a page fault.

        Args:
            shape: the result's shape.
            stream: non-negative ints naming the stream among the sampler
                seed's (a sharded word2vec run's chunk: ``(epoch, chunk)``).
            first: the stream's draw the result starts at (>= 0).

        Returns:
            the word ids, in ``[0, len(counts))``, never a word of count 0.
        """
        key = np.random.SeedSequence(self._seed, spawn_key=tuple(stream)).generate_state(2, np.uint64)
        # Philox makes four 64-bit words per counter value and a float64 uniform takes one: start at
        # the counter value holding draw `first`, and skip the draws before it.
        uniform = np.random.Generator(np.random.Philox(key=key, counter=first // 4))
        uniform.random(first % 4)
        out = torch.empty(shape, dtype=torch.int64, device=self._cdf.device)
        flat = out.view(-1)
        for start in range(0, len(flat), self.SLICE):
            part = flat[start:start + self.SLICE]
            part.copy_(self._draw(torch.from_numpy(uniform.random(len(part))).to(self._cdf.device)))
        return out

    def _draw(self, u: torch.Tensor) -> torch.Tensor:
        """The word of each uniform number of ``u`` (float64 in ``[0, 1)``, on the sampler's device).

        The word is the first whose CDF exceeds ``u``: its CDF is above its
        predecessor's, so its count is not 0 (the first whose CDF *reaches*
        ``u`` would be a leading word of count 0 for ``u == 0``, or a word of
        count 0 whose CDF equals ``u``). The CDF ends at 1.0, above every ``u``.
        """
        if self._guide is None:
            return torch.searchsorted(self._cdf, u, right=True)
        # The first word whose CDF exceeds u lies at most `steps` words past the guide's.
        word = self._guide[(u * self._buckets).long()]
        for _ in range(self._steps):
            word.add_(self._cdf[word] <= u)
        return word


def _groups(ids: torch.Tensor, bound: int) -> tuple:
    """Each distinct id of a 1-D tensor of ids in ``[0, bound)``, and where its occurrences are.

    On the CPU it runs in numpy, whose stable sort of 16-bit keys is a radix
    sort (ids up to 2**32 take two passes, least significant half first):
    2 to 4 times faster than torch's comparison sort and its small kernels
    at a few thousand ids. On a GPU torch's own sort is fast.

    Returns:
        ``(unique, order, starts)``: the sorted distinct ids; the
        occurrences sorted by id (a stable permutation); where each id's run
        starts in ``order``.
    """
    if ids.device.type != "cpu" or bound > 1 << 32:
        unique, inverse = torch.unique(ids, return_inverse=True)
        counts = torch.bincount(inverse, minlength=len(unique))
        return unique, torch.argsort(inverse, stable=True), counts.cumsum(0) - counts
    values = ids.numpy()
    order = np.argsort((values & 0xFFFF).astype(np.uint16), kind="stable")
    if bound > 1 << 16:
        order = order[np.argsort((values >> 16).astype(np.uint16)[order], kind="stable")]
    ranked = values[order]
    first = np.empty(len(values), dtype=bool)
    first[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    return torch.from_numpy(ranked[first]), torch.from_numpy(order), torch.from_numpy(np.flatnonzero(first))


@dataclasses.dataclass(frozen=True)
class PairBatch:
    """A batch of skip-gram pairs, its ids checked and grouped for the closed-form step; made by :meth:`plan`.

    The pairs are sorted by centre, so each centre's pairs are one run. The
    order of a batch's pairs does not change its gradients (every pair is
    scored with the same vectors), only the order in which float32 sums
    add them. Checking and grouping the ids took about a third of the
    closed-form step's time on a CPU; planned on a thread of their own
    (:meth:`PairChunks.batches`), batches arrive with it done.

    Attributes:
        centres: ``(B,)`` int64 centre ids, non-decreasing.
        ids: ``(B, 1 + K)`` int64: each pair's context id, then its K negatives.
        centre_rows: the distinct centres, ascending.
        centre_starts: where each distinct centre's pairs start in ``ids.view(-1)``
            (multiples of ``1 + K``).
        context_rows: the distinct ids of ``ids``, ascending.
        context_order: the positions of ``ids.view(-1)`` sorted by id (a
            stable sort), so each id's occurrences are one run.
        context_starts: where each distinct id's run starts in ``context_order``.
        context_pairs: the pair (row of ``ids``) of each position in ``context_order``.
        words: corpus words the batch stands for, its share of its chunk's
            tokens (progress and learning-rate schedules count them).
        block: for a batch made by :meth:`packed`, the one tensor every id
            tensor above is a view of (None otherwise).
    """

    centres: torch.Tensor
    ids: torch.Tensor
    centre_rows: torch.Tensor
    centre_starts: torch.Tensor
    context_rows: torch.Tensor
    context_order: torch.Tensor
    context_starts: torch.Tensor
    context_pairs: torch.Tensor
    words: float = 0.0
    block: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def plan(cls, centres, contexts, negatives, *, centre_rows: int, context_rows: int,
             words: float = 0.0) -> PairBatch:
        """Check a batch's ids and group them.

        Args:
            centres: ``(B,)`` centre ids (a tensor, array or list of ints).
            contexts: ``(B,)`` ids of words seen near the centres.
            negatives: ``(B, K)`` ids of sampled words.
            centre_rows, context_rows: the rows of the centre and the context
                table: every id must lie below its table's.
            words: what :attr:`words` records.

        Returns:
            the :class:`PairBatch`, on the ids' device.

        Raises:
            ShapeError: the three do not describe the same B pairs.
            DTypeError, DeviceError, IdError: ids that are not integers, or
                not on the CPU or the centres' device, or out of their table's range.
        """
        device = centres.device if isinstance(centres, torch.Tensor) else torch.device("cpu")
        centres, centre_shape = convert.as_row_ids(centres, centre_rows, device, what="centre ids")
        contexts, context_shape = convert.as_id_tensor(contexts, device, what="context ids")
        negatives, negative_shape = convert.as_id_tensor(negatives, device, what="negative ids")
        if len(centre_shape) != 1 or context_shape != centre_shape or negative_shape[:1] != centre_shape \
                or len(negative_shape) != 2:
            raise ss.ShapeError(f"a batch is B centres, B contexts and (B, K) negatives; got shapes "
                                f"{centre_shape}, {context_shape} and {negative_shape}")
        ids = torch.cat([contexts.unsqueeze(1), negatives.view(negative_shape)], dim=1)
        convert.check_id_range(ids.view(-1), context_rows, what="context and negative ids")
        columns = ids.shape[1]
        centre_ids, by_centre, centre_starts = _groups(centres, centre_rows)
        centres, ids = centres[by_centre], ids[by_centre]
        context_ids, order, context_starts = _groups(ids.view(-1), context_rows)
        return cls(centres, ids, centre_ids, centre_starts * columns, context_ids, order, context_starts,
                   order // columns, words)

    def __len__(self) -> int:
        return len(self.centres)

    @property
    def contexts(self) -> torch.Tensor:
        """``(B,)``: each pair's context id."""
        return self.ids[:, 0]

    @property
    def negatives(self) -> torch.Tensor:
        """``(B, K)``: each pair's negative ids (a view of :attr:`ids`)."""
        return self.ids[:, 1:]

    def context_slots(self) -> torch.Tensor:
        """``(B, 1 + K)``: where each of :attr:`ids` is in :attr:`context_rows`."""
        counts = torch.diff(self.context_starts, append=self.context_starts.new_tensor([self.ids.numel()]))
        local = torch.empty_like(self.context_order)
        local[self.context_order] = torch.repeat_interleave(
            torch.arange(len(self.context_rows), device=local.device), counts, output_size=self.ids.numel())
        return local.view(self.ids.shape)

    def _id_tensors(self) -> dict:
        return {name: getattr(self, name) for name in _ID_TENSORS}

    def packed(self, *, pin: bool = False) -> PairBatch:
        """The same batch with its id tensors laid out in one block (page-locked with ``pin``).

        Moving such a batch to a GPU is one copy, and an asynchronous one from
        page-locked memory. Each of the 8 tensors of an unpacked batch crosses
        from pageable memory, and CUDA makes the host wait for the stream's
        earlier work before each such copy: the step queued before it.

        Args:
            pin: page-lock the block (needs CUDA).

        Returns:
            the packed batch, on the CPU.
        """
        tensors = self._id_tensors()
        block = torch.empty(sum(t.numel() for t in tensors.values()), dtype=torch.int64, pin_memory=pin)
        packed = self._views(block)
        for name, tensor in tensors.items():
            getattr(packed, name).copy_(tensor)
        return packed

    def _views(self, block: torch.Tensor) -> PairBatch:
        """This batch's id tensors as views of ``block``, in :data:`_ID_TENSORS` order."""
        views, offset = {}, 0
        for name, tensor in self._id_tensors().items():
            views[name] = block[offset:offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
        return dataclasses.replace(self, block=block, **views)

    def to(self, device: torch.device) -> PairBatch:
        """The batch on ``device`` (itself when it is there already); a packed batch moves in one copy."""
        device = torch.device(device)
        if self.centres.device == device:
            return self
        if self.block is not None:
            # The block is never written again, and torch's page-locked allocator keeps
            # it from reuse until the copy has run: the copy need not be waited for.
            return self._views(self.block.to(device, non_blocking=True))
        moved = {name: tensor.to(device, non_blocking=True) for name, tensor in self._id_tensors().items()}
        return dataclasses.replace(self, **moved)


#: The id tensors of a :class:`PairBatch`, in the order :meth:`PairBatch.packed` lays them out.
_ID_TENSORS = tuple(field.name for field in dataclasses.fields(PairBatch)
                    if field.name not in ("words", "block"))


@dataclasses.dataclass
class Chunk:
    """The training examples of one stretch of the corpus, in random order.

    A pair's negatives are drawn when the pair is taken (:meth:`pairs`),
    from the chunk's stream of the sampler at the pair's place in it: a
    slice of the chunk costs that slice's draws only, and its negatives are
    the same whoever takes it and however the chunk is cut.

    Attributes:
        centres, contexts: ``(P,)`` int64 CPU tensors, one (centre, context) pair per row.
        tokens: corpus tokens the chunk covers (before subsampling): its share of an epoch.
        negatives: negative words per pair (K).
        sampler: draws them, on the CPU.
        stream: the chunk's stream of ``sampler``.
    """

    centres: torch.Tensor
    contexts: torch.Tensor
    tokens: int
    negatives: int
    sampler: NegativeSampler
    stream: tuple

    def pairs(self, start: int, stop: int) -> tuple:
        """Pairs ``[start, stop)`` (clipped to the chunk) and their negatives, drawn now.

        Returns:
            ``(centres, contexts, negatives)``: ``(n,)``, ``(n,)`` and ``(n, K)`` int64 CPU tensors.
        """
        centres, contexts = self.centres[start:stop], self.contexts[start:stop]
        negatives = self.sampler((len(centres), self.negatives), stream=self.stream,
                                 first=start * self.negatives)
        return centres, contexts, negatives

    def batches(self, batch_size: int, rows: int, *, pin: bool = False) -> Iterator[PairBatch]:
        """The chunk's pairs in planned batches of ``batch_size`` (the last one may be shorter), in order.

        Each batch stands for an equal share of the chunk's tokens; a chunk
        without pairs gives one empty batch, which carries its tokens.

        Args:
            batch_size: pairs per batch.
            rows: the vocabulary size (both tables' rows).
            pin: each batch :meth:`~PairBatch.packed` into page-locked memory, for a GPU.
        """
        count = max(1, -(-len(self.centres) // batch_size))
        for start in range(0, count * batch_size, batch_size):
            batch = PairBatch.plan(*self.pairs(start, start + batch_size), centre_rows=rows, context_rows=rows,
                                   words=self.tokens / count)
            yield batch.packed(pin=True) if pin else batch


class PairChunks:
    """Makes :class:`Chunk` s of a corpus, epoch after epoch, optionally on a background thread.

    Pairs are made per chunk of ``chunk_tokens`` tokens, so memory stays flat
    however long the corpus is. An epoch's subsampling, windows and shuffles
    come from its generator, the seed's ``SeedSequence`` child ``(epoch,)``,
    and each chunk's negatives from its ``(epoch, chunk)`` stream
    of a :class:`NegativeSampler` seeded with ``seed``, so the pairs and their
    negatives are the same with or without the thread, and however the
    chunks are cut.

    Args:
        corpus: the corpus.
        window: largest context reach (word2vec's dynamic window draws each
            centre's reach from ``1..window``).
        negatives: negative words per pair.
        subsample: subsampling threshold (:func:`~speedswap.apps.corpus.keep_probabilities`).
        chunk_tokens: tokens per chunk.
        seed: seeds subsampling, windows and negatives.
    """

    def __init__(self, corpus: Corpus, *, window: int, negatives: int, subsample: float, chunk_tokens: int,
                 seed: int):
        self._corpus = corpus
        self._window, self._negatives, self._chunk_tokens, self._seed = window, negatives, chunk_tokens, seed
        self._keep = keep_probabilities(corpus.counts, subsample)
        self._doc_id = np.searchsorted(corpus.doc_starts, np.arange(len(corpus.tokens)), side="right")
        self._sampler = NegativeSampler(corpus.counts, torch.device("cpu"), seed=seed)

    def epoch(self, epoch: int) -> Iterator[Chunk]:
        """The chunks of one pass over the corpus, made on the calling thread (their negatives: :meth:`Chunk.pairs`)."""
        # The seed's SeedSequence child (epoch,), as an order's epoch (speedswap.data.orders._generator):
        # default_rng([seed, epoch]) was default_rng(seed)'s stream at epoch 0 (synthetic_corpus's, for
        # the same seed), and seed + 2**32's epoch 0 was seed's epoch 1.
        rng = np.random.default_rng(np.random.SeedSequence(self._seed, spawn_key=(epoch,)))
        tokens = self._corpus.tokens
        for index, start in enumerate(range(0, len(tokens), self._chunk_tokens)):
            stop = min(start + self._chunk_tokens, len(tokens))
            centres, contexts = skipgram_pairs(tokens[start:stop], self._doc_id[start:stop], self._keep,
                                               self._window, rng)
            # Shuffled here, on the pair thread, so the training loop reads its batches in order:
            # contiguous copies instead of a random gather on the loop's own thread.
            shuffle = rng.permutation(len(centres))
            yield Chunk(torch.from_numpy(centres[shuffle]), torch.from_numpy(contexts[shuffle]), stop - start,
                        self._negatives, self._sampler, (epoch, index))

    def stream(self, epochs: int, *, ahead: int = 1) -> Background:
        """The chunks of ``epochs`` passes, made by a background thread up to ``ahead`` chunks early.

        The thread starts at once, so the first chunk is being made while
        the caller sets up the rest of its job (the tables, for word2vec).
        """
        def chunks():
            for epoch in range(epochs):
                yield from self.epoch(epoch)
        return Background(chunks, ahead=ahead, name="speedswap-w2v-pairs")

    def batches(self, epochs: int, *, batch_size: int, ahead_pairs: int = 1 << 19,
                pin: bool = False) -> Background:
        """The planned batches of ``epochs`` passes (:meth:`Chunk.batches`), in order.

        Two background threads: one makes the chunks (:meth:`stream`), the
        other cuts them into batches and plans them, up to about
        ``ahead_pairs`` pairs early (about 100 MB of plans at 2**19), and with
        ``pin`` packs each into page-locked memory (for a GPU: one
        asynchronous copy per batch).
        """
        chunks = self.stream(epochs)
        rows = self._corpus.vocab_size

        def planned():
            for chunk in chunks:
                yield from chunk.batches(batch_size, rows, pin=pin)
        return Background(planned, ahead=max(2, ahead_pairs // batch_size), name="speedswap-w2v-plans",
                          upstream=chunks)


class Background:
    """An iterator whose items a background thread makes, up to ``ahead`` of them early.

    The thread starts at once. An exception raised while making an item is
    raised by ``next``. ``close()`` (or leaving a ``with`` block) stops the
    thread, and first the ``upstream`` iterator it reads, if any; a loop
    left early must close it.

    Args:
        produce: called on the thread; returns the items' iterable.
        ahead: items made ahead of the one being consumed.
        name: the thread's name.
        upstream: a :class:`Background` that ``produce`` reads, closed with this one.

    Raises:
        ThreadStartError: the thread could not start (``upstream`` is closed first).
    """

    def __init__(self, produce: Callable[[], Iterable], *, ahead: int, name: str,
                 upstream: Optional[Background] = None):
        self._slots: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._finished = object()
        self._upstream = upstream
        self._thread = threading.Thread(target=self._produce, args=(produce,), name=name, daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:
            if upstream is not None:  # running already, and nobody would read or stop it
                upstream.close()
            raise ss.ThreadStartError(
                f"the {name!r} thread could not start ({exc}): the process is at its thread limit "
                f"or the interpreter is shutting down; end other threads (or raise the limit, "
                f"ulimit -u) and start the run again") from exc

    def _put(self, item) -> bool:
        # A timed put, so a stream closed early (stop set, nobody reading) never strands the thread.
        while not self._stop.is_set():
            try:
                self._slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, produce: Callable[[], Iterable]) -> None:
        try:
            for item in produce():
                if not self._put(item):
                    return
            self._put(self._finished)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(exc)

    def __iter__(self) -> Background:
        return self

    def __next__(self):
        # A timed get, so a thread reading this one (a downstream Background) sees a close.
        while True:
            if self._stop.is_set():
                raise StopIteration
            try:
                item = self._slots.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        if item is self._finished:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (and the upstream one) and wait for it (idempotent)."""
        self._stop.set()
        if self._upstream is not None:
            self._upstream.close()
        self._thread.join()

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
