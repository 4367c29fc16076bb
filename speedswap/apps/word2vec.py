"""Skip-gram word2vec with both embedding tables offloaded: the job behind the demo.

``python -m speedswap demo`` and ``examples/word2vec.py`` both run
:func:`train`; this module, :mod:`speedswap.apps.corpus` (the text) and
:mod:`speedswap.apps.pairs` (its training examples) hold everything they
share: the model, the training loop (with :class:`~speedswap.OffloadedEmbedding`
or with the SpeedTorch-style ``ModelFactory``/``OptimizerFactory`` switchers),
word2vec's learning-rate recipe, and the synthetic corpus's quality figure,
nearest-neighbour topic purity.

**What ``lr`` means.** The loss of a step is the *sum* of its pairs' losses,
never the mean, so the gradient each pair contributes does not depend on the
batch size: with ``optimizer="sgd"``, ``lr`` is the step size per pair, the
``-alpha`` of the word2vec C tool and gensim (0.025 for skip-gram). Adam and
Adamax normalise the gradient's scale away, so for them ``lr`` is the usual
per-coordinate step size. With ``schedule="linear"`` the rate falls linearly
to ``lr * 1e-4`` over the run, as word2vec's does.

>>> from speedswap.apps.corpus import synthetic_corpus
>>> corpus = synthetic_corpus(vocab=500, topics=10, tokens=20_000, seed=0)
>>> result = train(corpus, dim=16, steps=50, batch_size=256, backend="numpy", progress=False)
>>> result.vectors.shape
(500, 16)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable, Iterable, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

import speedswap as ss
from speedswap import convert

from .arguments import SEED_LIMIT
from .corpus import Corpus
from .pairs import NegativeSampler, PairBatch, PairChunks
from .skipgram import SkipGram, manual_step

__all__ = ["NegativeSampler", "SkipGram", "TrainResult", "train", "check_gives_pairs", "check_finite_loss",
           "cores_granted", "cpu_threads", "DEFAULT_LR",
           "CHUNK_TOKENS", "topic_purity", "purity_report", "nearest_neighbours"]

#: The default learning rate of each optimizer: word2vec's 0.025 per pair for SGD.
DEFAULT_LR = {"sgd": 0.025, "adam": 0.01, "adamax": 0.01}
_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamax": torch.optim.Adamax}
#: Corpus tokens made into pairs at a time (:func:`train`'s default), so memory stays flat whatever the corpus's length.
CHUNK_TOKENS = 1_000_000
#: word2vec's floor for the decayed rate, as a share of the starting rate.
_LR_FLOOR = 1e-4


def cores_granted() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(requested: Optional[int] = None) -> int:
    """How many torch threads a CPU run of :func:`train` should use.

    The run's thread budget is ``requested``, else ``OMP_NUM_THREADS`` when
    set, else every core this process may run on; never more than
    ``len(os.sched_getaffinity(0))``, since threads beyond the cores granted
    only contend. The threads that make pairs and negatives and plan the
    batches keep about half a core busy, so torch gets one thread fewer than
    the budget (at least one):
    a step is many small kernels, which gain little from a second thread and
    lose much when it competes with the pair thread (on 2 cores: 116k words/s
    with 1 torch thread, 83k with 2; see the README's word2vec section).

    Args:
        requested: the thread budget, like gensim's ``workers``.

    Returns:
        the count for ``torch.set_num_threads``.

    Raises:
        OptionError: ``requested`` (or ``OMP_NUM_THREADS``) is not a positive int.
    """
    available = cores_granted()
    if requested is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        try:
            requested = int(env) if env else available
        except ValueError:
            requested = 0
        if requested < 1:  # named as the user gave it: no threads= was passed
            raise ss.OptionError(f"OMP_NUM_THREADS={env!r} is not a positive int; unset it or give a "
                                 f"thread count")
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ss.OptionError(f"threads must be a positive int, got {requested!r}")
    return max(min(requested, available) - 1, 1)


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        vectors: the trained centre (input) vectors, ``(vocab, dim)`` numpy: a copy
            taken when training ended (further training of ``model`` leaves it as it
            is), in RAM beside the tables.
        losses: ``(step, mean loss per pair)`` of step 1, every 50th step after it, and the last step.
        words: corpus tokens read (before subsampling), word2vec's unit of speed.
        pairs: (centre, context) pairs trained on.
        steps: optimizer steps taken.
        seconds: wall time of the training loop.
        model, optimizer: kept for memory accounting and further use.
        storage: where the tables lived.
        autograd: whether autograd computed the gradients (else skip-gram's closed form).
        switchers: with the SpeedTorch API, the ModelFactory and
            OptimizerFactory objects that own the host tables (held here so
            the tables live as long as the result); empty otherwise, where
            the model's embeddings own them.
    """

    vectors: np.ndarray
    losses: list
    words: int
    pairs: int
    steps: int
    seconds: float
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    storage: str
    autograd: bool
    switchers: tuple = ()

    @property
    def words_per_second(self) -> float:
        """Corpus words read per second of training."""
        return self.words / self.seconds if self.seconds else float("nan")


def _check_fresh(directory: str, names: Sequence[str]) -> None:
    """Refuse files the job would make in ``directory`` that exist already, before it makes any.

    The tables are built one by one, and each refuses a file it did not make:
    checked table by table, a clash at the second would leave the first's files
    behind, and those would stop the next run.
    """
    taken = [name for name in names
             if os.path.isfile(os.path.join(directory, name)) or
             (os.path.isdir(os.path.join(directory, name)) and os.listdir(os.path.join(directory, name)))]
    if taken:
        raise ss.PathError(f"{directory!r} already holds {', '.join(taken)}: the job makes its table files "
                           f"afresh and does not replace files; give a new or empty directory, or remove them")


def _table_files(directory: Optional[str], name: str) -> Optional[str]:
    """Where an ``mmap`` table's files go: ``directory/name`` (None when not memory-mapped)."""
    return None if directory is None else os.path.join(directory, name)


def _capacities(vocab: int, batch_size: int, negatives: int) -> tuple:
    """The most distinct rows one step can touch in the centre and the context table."""
    return min(vocab, batch_size), min(vocab, batch_size * (negatives + 1))


@dataclasses.dataclass
class _Job:
    """What a training loop needs of a model: its optimizer, a step, the trained vectors, a prefetch.

    ``step(batch, between=None)`` trains one :class:`~speedswap.apps.pairs.PairBatch`
    and returns its loss; ``between()``, when given, runs once the batch's
    rows are in and before they are updated. ``prefetch(batch)`` (None when
    the API has none) starts bringing a batch's rows into the device caches.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[..., torch.Tensor]
    vectors: Callable[[], np.ndarray]
    prefetch: Optional[Callable[[PairBatch], None]] = None
    switchers: tuple = ()


def _build_offloaded(vocab, dim, batch_size, negatives, optimizer_cls, lr, seed, storage, backend,
                     directory, *, autograd, cache_rows):
    """The job with two OffloadedEmbedding tables."""
    def table(name, max_rows):
        return ss.OffloadedEmbedding(vocab, dim, max_rows=max_rows, storage=storage, backend=backend,
                                     path=_table_files(directory, name), cache_rows=cache_rows)

    # The context table is called once per step with the positives and negatives together.
    centre, context = (table(name, rows) for name, rows in zip(("centre", "context"),
                                                               _capacities(vocab, batch_size, negatives)))
    # word2vec's initialisation: small random input vectors, zero output vectors.
    centre.table.uniform_(-0.5 / dim, 0.5 / dim, generator=torch.Generator().manual_seed(seed))
    context.table.zero_()
    model = SkipGram(centre, context)
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    centre.attach(optimizer)
    context.attach(optimizer)

    def vectors():
        centre.flush()  # cached rows are newer than the host table's
        context.flush()
        # A copy, as the switchers' getNumpyVersion: a view kept by the result would hold the
        # device cache empty for any further training, and a GPU table's view is a copy anyway.
        return centre.table.to_numpy(copy=True)

    def prefetch(batch):
        centre.prefetch(batch.centres)
        context.prefetch(batch.ids)

    def step(batch, between=None):
        loss = model(batch.centres, batch.contexts, batch.negatives)
        if between is not None:
            between()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # the attached hooks write rows and state back to the host
        return loss.detach()

    return _Job(model, optimizer, step if autograd else manual_step(centre, context, optimizer), vectors,
                prefetch)


def _build_speedtorch(vocab, dim, batch_size, negatives, optimizer_cls, lr, seed, storage, backend,
                      directory, *, cache_rows):
    """The same job written the SpeedTorch way: batch-sized nn.Embeddings plus switchers."""
    device = ss.get_backend(backend).device
    rows = _capacities(vocab, batch_size, negatives)
    if directory is not None:
        # The switchers save their .npy files into an existing directory; OffloadedEmbedding
        # makes its own, so the run makes this one, as the other API's run does.
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ss.PathError(f"cannot make the directory {directory!r} for the table files "
                               f"({exc.strerror}); pass a writable directory") from None
    model = SkipGram(torch.nn.Embedding(rows[0], dim), torch.nn.Embedding(rows[1], dim)).to(device)
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    options = dict(storage=storage, backend=backend, cache_rows=cache_rows)
    u_switch = ss.ModelFactory(model.centre, vocab, dim, path=_table_files(directory, "centre.npy"),
                               **options)
    v_switch = ss.ModelFactory(model.context, vocab, dim, path=_table_files(directory, "context.npy"),
                               **options)
    torch.manual_seed(seed)  # SpeedTorch's initialisers draw from torch's global generator
    u_switch.uniformDistributionInit(-0.5 / dim, 0.5 / dim)
    v_switch.zerosInit()
    u_opt = ss.OptimizerFactory(optimizer, vocab, dim, model, "centre",
                                path=_table_files(directory, "centre-state"), **options)
    v_opt = ss.OptimizerFactory(optimizer, vocab, dim, model, "context",
                                path=_table_files(directory, "context-state"), **options)
    u_opt.optInit()
    v_opt.optInit()

    def step(batch, between=None):
        centres, contexts, negative_ids = batch.centres, batch.contexts, batch.negatives
        local_centres = u_switch.beforeForwardPass(centres)
        local_contexts, local_negatives = v_switch.beforeForwardPass(contexts, negative_ids)
        u_opt.beforeForwardPass(centres)
        v_opt.beforeForwardPass(contexts, negative_ids)
        loss = model(local_centres, local_contexts, local_negatives)
        if between is not None:
            between()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_switch.afterOptimizerStep(centres)
        v_switch.afterOptimizerStep(contexts, negative_ids)
        u_opt.afterOptimizerStep(centres)
        v_opt.afterOptimizerStep(contexts, negative_ids)
        return loss.detach()

    def prefetch(batch):
        u_switch.prefetch(batch.centres)
        v_switch.prefetch(batch.contexts, batch.negatives)

    return _Job(model, optimizer, step, u_switch.getNumpyVersion, prefetch,
                switchers=(u_switch, v_switch, u_opt, v_opt))


def _check_run_length(epochs: Optional[int], steps: Optional[int]) -> tuple:
    """``(epochs, steps)`` as ints (epochs 1 when neither is given), if at most one is given and it is positive."""
    if epochs is not None and steps is not None:
        raise ss.OptionError("give the run's length either as epochs (passes over the corpus) or as "
                             "steps, not both")
    epochs, steps = (None if value is None else convert.int_option(value, name)
                     for name, value in (("epochs", epochs), ("steps", steps)))
    return (1 if epochs is None and steps is None else epochs), steps


def _check_offloading(speedtorch_api: bool, autograd: Optional[bool], cache_rows: int, prefetch: bool) -> int:
    """``cache_rows`` as an int, if it and the other offloading options go together."""
    cache_rows = convert.int_option(cache_rows, "cache_rows", minimum=0, hint=" (0: no cache)")
    if prefetch and not cache_rows:
        raise ss.OptionError("prefetch brings the next batch's rows into the device cache; give "
                             "cache_rows > 0 as well")
    if speedtorch_api and autograd is False:
        raise ss.OptionError("the SpeedTorch API (ModelFactory/OptimizerFactory) trains with autograd; "
                             "drop autograd=False, or use OffloadedEmbedding (speedtorch_api=False)")
    return cache_rows


def _check_rate(lr: Optional[float], optimizer: str) -> float:
    """The learning rate: ``lr`` if it is a finite number > 0, the optimizer's default when None."""
    if lr is None:
        return DEFAULT_LR[optimizer]
    lr = convert.float_option(lr, "lr")
    if lr <= 0:
        raise ss.OptionError(f"lr must be > 0, got {lr!r}; None gives {optimizer}'s default, "
                             f"{DEFAULT_LR[optimizer]}")
    return lr


def train(corpus: Corpus, *, dim: int = 100, epochs: Optional[int] = None, steps: Optional[int] = None,
          batch_size: int = 8192, negatives: int = 5, window: int = 5, subsample: float = 1e-3,
          optimizer: str = "sgd", lr: Optional[float] = None, schedule: str = "linear",
          storage: str = "pinned", backend: str = "auto", directory: Optional[str] = None,
          speedtorch_api: bool = False, autograd: Optional[bool] = None, cache_rows: int = 0,
          prefetch: bool = False, chunk_tokens: int = CHUNK_TOKENS, seed: int = 0,
          progress: bool = True) -> TrainResult:
    """Train skip-gram vectors with both tables in host memory.

    Args:
        corpus: a :class:`~speedswap.apps.corpus.Corpus`.
        dim: vector length.
        epochs: passes over the corpus (default 1 when ``steps`` is not given).
        steps: optimizer steps instead of passes (the corpus is cycled as needed).
        batch_size: (centre, context) pairs per step.
        negatives: negative words per pair.
        window: largest context reach.
        subsample: subsampling threshold ``t`` (:func:`~speedswap.apps.corpus.keep_probabilities`).
        optimizer: ``"sgd"`` (word2vec's own), ``"adam"`` or ``"adamax"``
            (dense optimizers, which sparse embedding training could not use
            before offloading; their state is offloaded with the tables).
        lr: learning rate; None is :data:`DEFAULT_LR` of the optimizer. See
            the module's note for what it means per pair.
        schedule: ``"linear"`` (word2vec's decay to ``lr * 1e-4`` over the
            run's words, or its steps) or ``"constant"``.
        storage: speedswap storage kind of the tables and optimizer state.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        directory: for ``storage="mmap"``, where the table and state files go
            (``centre/``, ``context/``; with the SpeedTorch API ``centre.npy``,
            ``context.npy``, ``centre-state/``, ``context-state/``); none of them
            may exist yet (empty directories may). Needed with ``storage="mmap"``, refused with
            other storage kinds.
        speedtorch_api: train through ``ModelFactory``/``OptimizerFactory``
            instead of :class:`~speedswap.OffloadedEmbedding` (always with autograd).
        autograd: differentiate :class:`~speedswap.apps.skipgram.SkipGram`
            with autograd (True) or use its closed-form gradients
            (:func:`~speedswap.apps.skipgram.manual_step`, False: the same
            gradients to float32 rounding; 2.2 times the words/s on a 2-core
            CPU). None: closed form for SGD on the CPU; autograd
            for Adam and Adamax, whose per-coordinate normalisation turns the
            rounding of gradient entries near zero into visible differences
            (so their runs stay those of earlier versions), and on a GPU,
            where the closed form gained little in its first run (310,651
            against 290,417 words/s on an H200, ``benchmarks/README.md``).
        cache_rows: rows of each table (with their optimizer state) kept on
            the device between steps, a cache of the most used rows (see
            :class:`~speedswap.OffloadedEmbedding`, or the switchers' with
            ``speedtorch_api``); 0: none. The vectors are the same with or without it.
        prefetch: while a step computes, start bringing the next batch's
            rows into the caches (needs ``cache_rows``); on a GPU the copies
            overlap the step.
        chunk_tokens: tokens turned into pairs at a time (a background thread
            makes the next chunk while one trains, and another one cuts
            them into batches and plans those, see :meth:`PairChunks.batches`).
        seed: seeds the initial vectors, subsampling, windows, order and negatives.
        progress: show a tqdm bar with words/s and the learning rate (only
            when stderr is a terminal, so logs of a redirected run are not flooded).

    Returns:
        TrainResult

    Raises:
        OptionError: an unknown optimizer or schedule, both or neither-valid
            ``epochs``/``steps``, a bad ``cache_rows``, ``prefetch`` without a
            cache, the SpeedTorch API without autograd, or a corpus without a
            document of two or more words; a size that is not a positive int (``dim``,
            ``batch_size``, ``window``, ``chunk_tokens``), ``negatives`` or
            ``seed`` below 0, ``seed`` not below 2**32, ``lr`` not > 0,
            ``subsample`` below 0, infinite or NaN, or ``directory`` without
            ``storage="mmap"`` or ``storage="mmap"`` without it. All are checked before the
            pair thread starts or a table is built. Also raised, after the
            tables are built, when subsampling left a whole pass without a pair.
        DTypeError: ``lr`` or ``subsample`` is not a real number.
        PathError: with ``storage="mmap"``, table files of the job exist in ``directory``.
    """
    epochs, steps = _check_run_length(epochs, steps)
    cache_rows = _check_offloading(speedtorch_api, autograd, cache_rows, prefetch)
    if optimizer not in _OPTIMIZERS:
        raise ss.OptionError(f"unknown optimizer {optimizer!r}; choose one of {sorted(_OPTIMIZERS)}")
    if schedule not in ("linear", "constant"):
        raise ss.OptionError(f"unknown schedule {schedule!r}; choose 'linear' or 'constant'")
    # All checked here: once the pair thread starts, a bad size would fail there, or after the tables exist.
    lr = _check_rate(lr, optimizer)
    dim = convert.int_option(dim, "dim", hint=" (the vector length)")
    batch_size = convert.int_option(batch_size, "batch_size", hint=" (pairs per step)")
    negatives = convert.int_option(negatives, "negatives", minimum=0, hint=" (negative words per pair)")
    window = convert.int_option(window, "window", hint=" (the largest context reach)")
    chunk_tokens = convert.int_option(chunk_tokens, "chunk_tokens", hint=" (tokens made into pairs at a time)")
    seed = convert.int_option(seed, "seed", minimum=0)
    if seed >= SEED_LIMIT:
        raise ss.OptionError(f"seed must be below 2**32, got {seed}")
    subsample = convert.float_option(subsample, "subsample")
    if subsample < 0:
        raise ss.OptionError(f"subsample must be >= 0 (0: keep every word), got {subsample!r}")
    check_gives_pairs(corpus)
    if directory is not None and storage != "mmap":
        raise ss.OptionError(f"directory={os.fspath(directory)!r} is where storage='mmap' keeps the table "
                             f"files, but storage is {storage!r}; drop directory or use storage='mmap'")
    if storage == "mmap" and directory is None:
        raise ss.OptionError("storage='mmap' keeps the tables in files: pass directory= a new or empty "
                             "directory for them, or use another storage")
    if storage == "mmap":
        _check_fresh(directory, ("centre.npy", "context.npy", "centre-state", "context-state") if speedtorch_api
                     else ("centre", "context"))
    args = (corpus.vocab_size, dim, batch_size, negatives, _OPTIMIZERS[optimizer], lr, seed, storage, backend,
            directory)
    device = ss.get_backend(backend).device
    if autograd is None:
        autograd = speedtorch_api or optimizer != "sgd" or device.type != "cpu"
    chunks = PairChunks(corpus, window=window, negatives=negatives, subsample=subsample,
                        chunk_tokens=chunk_tokens, seed=seed)
    # Started before the tables are built, so the first chunk's pairs are made meanwhile;
    # an endless stream in steps mode, which the loop stops.
    with chunks.batches(epochs if steps is None else 1 << 30, batch_size=batch_size,
                        pin=device.type == "cuda") as stream:
        job = (_build_speedtorch(*args, cache_rows=cache_rows) if speedtorch_api
               else _build_offloaded(*args, autograd=autograd, cache_rows=cache_rows))
        run = _Run(len(corpus.tokens), epochs if steps is None else None, steps)
        seconds = run.train(job, stream, device=device, linear=schedule == "linear", prefetch=prefetch,
                            progress=progress)
    if not run.steps:
        raise ss.OptionError(f"the corpus ({len(corpus.tokens):,} tokens) gave no skip-gram pairs in a pass: "
                             f"subsampling (subsample={subsample}) kept no two words of a document; "
                             f"lower subsample (0 keeps every word) or give a longer corpus")
    return TrainResult(vectors=job.vectors(), losses=run.losses, words=int(round(run.words)), pairs=run.pairs,
                       steps=run.steps, seconds=seconds, model=job.model, optimizer=job.optimizer,
                       storage=storage, autograd=autograd, switchers=job.switchers)


def check_gives_pairs(corpus: Corpus) -> None:
    """Refuse a corpus without a document of two or more words: no window holds a pair.

    Checked before a run builds anything, not only once a pass gave no pairs:
    by then the tables (an mmap run's files) exist, and a sharded run has
    joined its process group.

    Raises:
        OptionError: no document of ``corpus`` has two or more words.
    """
    if not (np.diff(corpus.doc_starts, append=len(corpus.tokens)) >= 2).any():
        raise ss.OptionError(f"the corpus ({len(corpus.tokens):,} tokens) gives no skip-gram pairs; "
                             f"it needs documents of two or more words")


def check_finite_loss(loss: tuple, pairs: int, lr: float) -> None:
    """Stop a run whose loss overflowed: every step after it trains on infinities, and its vectors are noise.

    Args:
        loss: ``(step, loss per pair)`` as read.
        pairs: the step's pairs (all ranks' in a sharded run).
        lr: the run's learning rate, for the message.

    Raises:
        OptionError: the loss per pair is infinite or NaN.
    """
    step, value = loss
    if not np.isfinite(value):
        raise ss.OptionError(
            f"training diverged: the loss per pair was {value} at step {step:,} ({pairs:,} pairs a step, "
            f"learning rate {lr:.3g}). A step's loss sums its pairs', so a frequent word's row takes as many "
            f"updates at once as it has pairs in the batch; lower the learning rate or the batch size "
            f"(--lr, --batch-size)")


class _Run:
    """The training loop's progress: words read, steps and pairs trained, losses; and the loop itself.

    Args:
        pass_words: the corpus's length in words.
        epochs: the run's length in passes over the corpus, or None.
        total_steps: its length in steps, or None.
    """

    def __init__(self, pass_words: int, epochs: Optional[int], total_steps: Optional[int]):
        self.pass_words, self.total_steps = pass_words, total_steps
        self.total_words = None if epochs is None else pass_words * epochs
        self.words, self.steps, self.pairs = 0.0, 0, 0
        self.losses: list = []

    def remaining(self) -> float:
        """The share of the run still to go."""
        if self.total_steps is not None:
            return 1 - self.steps / self.total_steps
        return 1 - self.words / self.total_words

    def train(self, job: _Job, stream: Iterable[PairBatch], *, device: torch.device, linear: bool,
              prefetch: bool, progress: bool) -> float:
        """Train ``job`` on ``stream``'s batches until the run's length; returns the seconds it took."""
        # word2vec's decay: linear in the share of the run already read, with a floor.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            job.optimizer, lambda _: max(self.remaining(), _LR_FLOOR) if linear else 1.0)
        # disable=None: tqdm draws only on a terminal.
        bar = tqdm(total=self.total_steps or self.total_words, unit="step" if self.total_steps else "word",
                   unit_scale=not self.total_steps, disable=None if progress else True, dynamic_ncols=True,
                   smoothing=0.05)
        # One batch ahead, so the next batch's rows can be prefetched.
        batches = (batch.to(device) for batch in stream)
        start = time.perf_counter()
        with bar:
            batch = next(batches, None)
            while batch is not None:
                upcoming = next(batches, None)
                if not len(batch):  # a stretch of the corpus without pairs
                    self.words += batch.words
                    if not self.steps and self.words >= self.pass_words:
                        break  # a whole pass without a pair: no run length would change that
                    batch = upcoming
                    continue
                ahead = functools.partial(job.prefetch, upcoming) if prefetch and upcoming else None
                loss = job.step(batch, ahead)
                self.words += batch.words
                self.steps += 1
                self.pairs += len(batch)
                scheduler.step()  # the next step's rate, from the share read so far
                last = (loss, len(batch))
                # Reading the loss synchronises a GPU; do it only as often as the bar redraws.
                if self.steps % 50 == 1 or self.steps == self.total_steps:
                    self._record(*last, scheduler)
                    bar.set_postfix(loss=f"{self.losses[-1][1]:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                                    refresh=False)
                bar.update(1 if self.total_steps else batch.words)
                if self.steps == self.total_steps:
                    break
                batch = upcoming
        if self.steps and self.losses[-1][0] != self.steps:  # a run of epochs ends on any step
            self._record(*last, scheduler)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def _record(self, loss: torch.Tensor, pairs: int, scheduler) -> None:
        """Append the step's loss per pair to :attr:`losses`, stopping a run whose loss overflowed."""
        self.losses.append((self.steps, float(loss) / pairs))
        check_finite_loss(self.losses[-1], pairs, scheduler.base_lrs[0])


def nearest_neighbours(vectors: np.ndarray, query_ids: Sequence[int], candidate_ids: Sequence[int],
                       k: int = 10) -> np.ndarray:
    """The ``k`` nearest candidates (by cosine) of each query, excluding itself.

    Returns:
        ``(len(query_ids), k)`` numpy array of candidate word ids.

    Raises:
        OptionError: ``k`` is below 0, or more than the candidates a query can have
            (one fewer than the candidates when a query is among them).
    """
    def unit(ids):
        v = torch.from_numpy(np.ascontiguousarray(vectors[ids], dtype=np.float32))
        return v / v.norm(dim=1, keepdim=True).clamp_min(1e-12)

    candidate_ids = np.asarray(candidate_ids)
    k = convert.int_option(k, "k", minimum=0, hint=" (neighbours per query)")
    # A query is excluded from its own list by scoring it lowest: asked for every candidate, topk would list it.
    available = len(candidate_ids) - bool(np.isin(query_ids, candidate_ids).any())
    if k > available:
        raise ss.OptionError(f"k={k} neighbours asked of {len(candidate_ids):,} candidates; a query has at most "
                             f"{available:,} (a query is not its own neighbour): give k <= {available:,}")
    sim = unit(query_ids) @ unit(candidate_ids).T
    sim[torch.from_numpy(np.asarray(query_ids)[:, None] == candidate_ids[None, :])] = -2.0
    return candidate_ids[sim.topk(k, dim=1).indices.numpy()]


def topic_purity(vectors: np.ndarray, corpus: Corpus, *, words: int = 1000, k: int = 10,
                 min_count: int = 20) -> tuple:
    """Share of each word's nearest neighbours that belong to its planted topic.

    Scored over the ``words`` most frequent words with at least ``min_count``
    occurrences (rarer ones have too little signal to judge the library by).
    Random vectors score the chance level, the share of same-topic pairs among
    the scored words; a model that learned the topics scores near 1.

    Returns:
        (purity, chance): two floats.

    Raises:
        OptionError: the corpus has no planted topics, or too few frequent words to score.
    """
    if corpus.topics is None:
        raise ss.OptionError("topic purity needs a synthetic corpus with planted topics "
                             "(synthetic_corpus); a text corpus has none to score against")
    ranked = np.argsort(-corpus.counts, kind="stable")[:words]
    scored = ranked[corpus.counts[ranked] >= min_count]
    if len(scored) <= k:
        raise ss.OptionError(f"only {len(scored)} words occur {min_count}+ times; "
                         f"make the corpus longer to score topic purity")
    topic = corpus.topics[scored]
    neighbours = nearest_neighbours(vectors, scored, scored, k)
    purity = float((corpus.topics[neighbours] == topic[:, None]).mean())
    sizes = np.bincount(topic).astype(np.float64)
    chance = float((sizes * (sizes - 1)).sum() / (len(scored) * (len(scored) - 1)))
    return purity, chance


def purity_report(vectors: np.ndarray, corpus: Corpus) -> Tuple[dict, str]:
    """:func:`topic_purity` for a run's report, which a corpus too short to score does not end.

    Args:
        vectors: the trained centre vectors.
        corpus: a synthetic corpus (with planted topics).

    Returns:
        ``({"topic_purity": ..., "chance": ...}, "0.912  (chance 0.251)")``;
        ``({}, "not scored: ...")`` when too few words occur often enough to score.
    """
    try:
        purity, chance = topic_purity(vectors, corpus)
    except ss.OptionError as exc:  # raised after training: the run's other figures still stand
        return {}, f"not scored: {exc}"
    return {"topic_purity": purity, "chance": chance}, f"{purity:.3f}  (chance {chance:.3f})"
