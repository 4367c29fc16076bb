"""Skip-gram word2vec with both embedding tables offloaded: the job behind the demo.

``python -m speedswap demo`` and ``examples/word2vec.py`` both run
:func:`train`; this module and :mod:`speedswap.apps.corpus` (the text and its
pairs) hold everything they share, so neither copies the other: the
unigram^0.75 negative sampler, the model, the training loop (with
:class:`~speedswap.OffloadedEmbedding` or with the SpeedTorch-style
``ModelFactory``/``OptimizerFactory`` switchers), and the quality figure,
nearest-neighbour topic purity.

>>> from speedswap.apps.corpus import synthetic_corpus
>>> corpus = synthetic_corpus(vocab=500, topics=10, tokens=20_000, seed=0)
>>> result = train(corpus, dim=16, steps=50, batch_size=256, backend="numpy", progress=False)
>>> result.vectors.shape
(500, 16)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import speedswap as ss

from .corpus import Corpus, keep_probabilities, skipgram_pairs

__all__ = ["NegativeSampler", "SkipGram", "TrainResult", "train", "topic_purity", "nearest_neighbours"]


class NegativeSampler:
    """Draws negative words from the unigram distribution raised to ``power`` (0.75).

    Sampling is an inverse-CDF lookup on the device (``torch.searchsorted``),
    so it needs no multi-hundred-megabyte table for large vocabularies and
    never draws a word that does not occur.
    """

    def __init__(self, counts: Sequence[int], device: torch.device, power: float = 0.75, seed: int = 0):
        weight = np.asarray(counts, dtype=np.float64) ** power
        self._cdf = torch.from_numpy(np.cumsum(weight) / weight.sum()).to(device)
        self._generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, shape: Sequence[int]) -> torch.Tensor:
        """Negative word ids of ``shape`` (int64, on the sampler's device)."""
        u = torch.rand(shape, dtype=torch.float64, device=self._cdf.device, generator=self._generator)
        return torch.searchsorted(self._cdf, u).clamp_(max=len(self._cdf) - 1)


class SkipGram(torch.nn.Module):
    """Skip-gram with negative sampling over two embedding modules.

    ``centre`` and ``context`` are anything called like ``nn.Embedding``:
    :class:`~speedswap.OffloadedEmbedding` (global word ids) or a small
    ``nn.Embedding`` batch buffer fed local ids by SpeedTorch-style switchers.
    The context table is called once per step with the positive and negative
    ids together, so each row it holds is gathered once.
    """

    def __init__(self, centre: torch.nn.Module, context: torch.nn.Module):
        super().__init__()
        self.centre = centre
        self.context = context

    def forward(self, centres: torch.Tensor, contexts: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        """Mean negative-sampling loss of a batch.

        Args:
            centres: ``(B,)`` ids.
            contexts: ``(B,)`` ids of words seen near the centres.
            negatives: ``(B, K)`` ids of sampled words.
        """
        u = self.centre(centres)
        v = self.context(torch.cat([contexts, negatives.reshape(-1)]))
        positive, negative = v[:len(contexts)], v[len(contexts):].view(*negatives.shape, -1)
        score = F.logsigmoid((u * positive).sum(-1))
        score = score + F.logsigmoid(-torch.bmm(negative, u.unsqueeze(-1)).squeeze(-1)).sum(-1)
        return -score.mean()


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        vectors: the trained centre (input) vectors, ``(vocab, dim)`` numpy.
        losses: mean loss of each step.
        words: corpus tokens read (before subsampling), word2vec's unit of speed.
        pairs: (centre, context) pairs trained on.
        seconds: wall time of the training loop.
        model, optimizer: kept for memory accounting and further use.
        storage: where the tables lived.
    """

    vectors: np.ndarray
    losses: list
    words: int
    pairs: int
    seconds: float
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    storage: str

    @property
    def words_per_second(self) -> float:
        """Corpus words read per second of training."""
        return self.words / self.seconds if self.seconds else float("nan")


def _batches(corpus: Corpus, *, batch_size: int, window: int, subsample: float, chunk_tokens: int,
             device: torch.device, seed: int) -> Iterator[tuple]:
    """Endless (centres, contexts, words_read) batches, one corpus chunk at a time.

    Pairs are made per chunk of ``chunk_tokens`` tokens, so memory stays flat
    however long the corpus is, and shuffled within the chunk by the feeder.

    Raises:
        OptionError: a whole pass over the corpus gives no full batch.
    """
    rng = np.random.default_rng(seed)
    keep_prob = keep_probabilities(corpus.counts, subsample)
    doc_id = np.searchsorted(corpus.doc_starts, np.arange(len(corpus.tokens)), side="right")
    for epoch in itertools.count():
        batches = 0
        for start in range(0, len(corpus.tokens), chunk_tokens):
            stop = min(start + chunk_tokens, len(corpus.tokens))
            centres, contexts = skipgram_pairs(corpus.tokens[start:stop], doc_id[start:stop],
                                               keep_prob, window, rng)
            if len(centres) < batch_size:
                continue
            feeder = ss.BatchFeeder(centres, contexts, batch_size=batch_size, order="random",
                                 drop_last=True, seed=seed + epoch, device=device)
            words_per_batch = (stop - start) / len(feeder)
            for batch_centres, batch_contexts in feeder:
                batches += 1
                yield batch_centres, batch_contexts, words_per_batch
        if batches == 0:
            raise ss.OptionError(f"a pass over the corpus ({len(corpus.tokens):,} tokens) gives fewer "
                             f"than batch_size={batch_size} pairs per chunk; use a smaller "
                             f"batch_size or a longer corpus")


def _table_files(directory: Optional[str], name: str) -> Optional[str]:
    """Where an ``mmap`` table's files go: ``directory/name`` (None when not memory-mapped)."""
    return None if directory is None else os.path.join(directory, name)


def _build_offloaded(vocab, dim, batch_size, negatives, optimizer_cls, lr, seed, storage, backend,
                     directory):
    """Model, optimizer, step function and vector getter with two OffloadedEmbedding tables."""
    def table(name, max_rows):
        return ss.OffloadedEmbedding(vocab, dim, max_rows=max_rows, storage=storage, backend=backend,
                                     path=_table_files(directory, name))

    # The context table is called once per step with the positives and negatives together.
    centre, context = table("centre", batch_size), table("context", batch_size * (negatives + 1))
    # word2vec's initialisation: small random input vectors, zero output vectors.
    centre.table.uniform_(-0.5 / dim, 0.5 / dim, generator=torch.Generator().manual_seed(seed))
    context.table.zero_()
    model = SkipGram(centre, context)
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    centre.attach(optimizer)
    context.attach(optimizer)

    def step(centres, contexts, negative_ids):
        loss = model(centres, contexts, negative_ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # the attached hooks write rows and state back to the host
        return loss.detach()

    return model, optimizer, step, centre.table.to_numpy


def _build_speedtorch(vocab, dim, batch_size, negatives, optimizer_cls, lr, seed, storage, backend,
                      directory):
    """The same job written the SpeedTorch way: batch-sized nn.Embeddings plus switchers."""
    device = ss.get_backend(backend).device
    model = SkipGram(torch.nn.Embedding(batch_size, dim),
                     torch.nn.Embedding(batch_size * (negatives + 1), dim)).to(device)
    optimizer = optimizer_cls(model.parameters(), lr=lr)
    options = dict(storage=storage, backend=backend)
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

    def step(centres, contexts, negative_ids):
        local_centres = u_switch.beforeForwardPass(centres)
        local_contexts, local_negatives = v_switch.beforeForwardPass(contexts, negative_ids)
        u_opt.beforeForwardPass(centres)
        v_opt.beforeForwardPass(contexts, negative_ids)
        loss = model(local_centres, local_contexts, local_negatives)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        u_switch.afterOptimizerStep(centres)
        v_switch.afterOptimizerStep(contexts, negative_ids)
        u_opt.afterOptimizerStep(centres)
        v_opt.afterOptimizerStep(contexts, negative_ids)
        return loss.detach()

    return model, optimizer, step, u_switch.getNumpyVersion


_OPTIMIZERS = {"adam": torch.optim.Adam, "adamax": torch.optim.Adamax}


def train(corpus: Corpus, *, dim: int = 64, steps: int = 1000, batch_size: int = 2048, negatives: int = 5,
          window: int = 4, subsample: float = 1e-3, lr: float = 0.01, optimizer: str = "adam",
          storage: str = "pinned", backend: str = "auto", directory: Optional[str] = None,
          speedtorch_api: bool = False, chunk_tokens: int = 1_000_000, seed: int = 0,
          progress: bool = True) -> TrainResult:
    """Train skip-gram vectors with both tables in host memory.

    Args:
        corpus: a :class:`~speedswap.apps.corpus.Corpus`.
        dim: vector length.
        steps: optimizer steps (the corpus is cycled as needed).
        batch_size: (centre, context) pairs per step.
        negatives: negative words per pair.
        window: largest context reach.
        subsample: subsampling threshold ``t`` (:func:`keep_probabilities`).
        lr: learning rate.
        optimizer: ``"adam"`` or ``"adamax"`` -- dense optimizers, which
            sparse embedding training could not use before offloading.
        storage: speedswap storage kind of the tables and optimizer state.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        directory: for ``storage="mmap"``, where the table and state files go.
        speedtorch_api: train through ``ModelFactory``/``OptimizerFactory``
            instead of :class:`~speedswap.OffloadedEmbedding`.
        chunk_tokens: tokens turned into pairs at a time.
        seed: seeds the initial vectors, subsampling, windows, order and negatives.
        progress: show a tqdm bar with words/s (only when stderr is a
            terminal, so logs of a redirected run are not flooded).

    Returns:
        TrainResult

    Raises:
        OptionError: an unknown optimizer, or a corpus too short for one batch.
    """
    if optimizer not in _OPTIMIZERS:
        raise ss.OptionError(f"unknown optimizer {optimizer!r}; choose one of {sorted(_OPTIMIZERS)}")
    optimizer_cls = _OPTIMIZERS[optimizer]
    build = _build_speedtorch if speedtorch_api else _build_offloaded
    model, opt, step, vectors = build(corpus.vocab_size, dim, batch_size, negatives, optimizer_cls,
                                      lr, seed, storage, backend, directory)
    device = ss.get_backend(backend).device
    sampler = NegativeSampler(corpus.counts, device, seed=seed)
    batches = _batches(corpus, batch_size=batch_size, window=window, subsample=subsample,
                       chunk_tokens=chunk_tokens, device=device, seed=seed)
    losses, words = [], 0.0
    # disable=None: tqdm draws only on a terminal.
    bar = tqdm(total=steps, unit="step", disable=None if progress else True, dynamic_ncols=True)
    start = time.perf_counter()
    for n in range(steps):
        centres, contexts, words_read = next(batches)
        loss = step(centres, contexts, sampler((batch_size, negatives)))
        words += words_read
        # Reading the loss synchronises a GPU; do it only as often as the bar redraws.
        if n % 20 == 0 or n == steps - 1:
            losses.append((n, float(loss)))
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{losses[-1][1]:.3f}", words_s=f"{words / elapsed:,.0f}", refresh=False)
        bar.update(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    bar.close()
    return TrainResult(vectors=vectors(), losses=losses, words=int(words), pairs=steps * batch_size,
                       seconds=seconds, model=model, optimizer=opt, storage=storage)


def nearest_neighbours(vectors: np.ndarray, query_ids: Sequence[int], candidate_ids: Sequence[int],
                       k: int = 10) -> np.ndarray:
    """The ``k`` nearest candidates (by cosine) of each query, excluding itself.

    Returns:
        ``(len(query_ids), k)`` numpy array of candidate word ids.
    """
    def unit(ids):
        v = torch.from_numpy(np.ascontiguousarray(vectors[ids], dtype=np.float32))
        return v / v.norm(dim=1, keepdim=True).clamp_min(1e-12)

    candidate_ids = np.asarray(candidate_ids)
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
