"""The word2vec demo's words/s: on a GPU with both tables offloaded, against the CPU of the same machine.

Every contender is a whole :func:`speedswap.apps.word2vec.train` run (or
gensim's) over the demo's synthetic corpus, so the figure is the job's, pair
making, feeding and the learning-rate schedule included:

* ``cpu``: the numpy backend with pageable tables and
  :func:`~speedswap.apps.word2vec.cpu_threads` threads, what
  ``python -m speedswap demo --device cpu`` runs.
* ``gpu``: the cuda backend with pinned tables and the demo's recipe.
* ``gpu closed form``: the same without autograd
  (:func:`~speedswap.apps.skipgram.manual_step`).
* ``gpu cache + prefetch``: a device cache of 5% of each table's rows, the
  next batch's rows prefetched while a step computes.
* ``gpu batch x4``: 4 times the job's pairs per step (32,768 for the demo: a
  step of 8,192 pairs may be mostly kernel launches and host synchronisations
  on a GPU). A multiple, not a fixed size: 32,768 pairs a step diverge on the
  tiny job's 2,000 words, a step's loss summing its pairs'.
* ``gensim``: gensim's ``Word2Vec(sg=1)`` with the same settings and one
  worker per core this process may use, when gensim is installed (an
  optional extra: carry its wheel to a machine without network).

The contenders run in rounds, each once per round in a rotating order, and
report the median words/s; topic purity (against chance) says each trained
vectors, not just spent time.

>>> payload = run(DEMO_SIZES["tiny"], rounds=1, gpu=False, gensim=False)
>>> [c["name"] for c in payload["contenders"]], payload["contenders"][0]["words_per_second"] > 0
(['cpu'], True)
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Optional

import numpy as np
import torch

from .. import word2vec
from ..corpus import Corpus, synthetic_corpus
from ..demo import DEMO, TINY
from .timing import format_table, load_average

__all__ = ["DEMO_SIZES", "CPU_TARGET", "GENSIM_TARGET", "CACHE_FRACTION", "GPU_CONTENDERS", "gensim_missing",
           "run", "format_results"]

#: The corpora: the demo's, and the test suite's.
DEMO_SIZES = {"demo": DEMO, "tiny": TINY}
#: GPU words/s over the same job on this machine's CPU.
CPU_TARGET = (">=", 1.0)
#: GPU words/s over gensim's on this machine's cores (the word2vec issue's target).
GENSIM_TARGET = (">=", 10.0)
#: The cached contender's cache, as a share of each table's rows.
CACHE_FRACTION = 0.05
#: The GPU contenders: their name and what they change in the demo's recipe.
GPU_CONTENDERS = {"gpu": {}, "gpu closed form": {"autograd": False},
                  "gpu cache + prefetch": {"cache_fraction": CACHE_FRACTION, "prefetch": True},
                  "gpu batch x4": {"batch_scale": 4}}
# The skip-gram settings every contender shares (gensim's defaults, and word2vec.train's).
_WINDOW, _NEGATIVES, _SUBSAMPLE = 5, 5, 1e-3


def gensim_missing() -> Optional[str]:
    """Why gensim's contender cannot run here, or None when it can."""
    try:
        import gensim  # noqa: F401
    except ImportError as exc:
        return (f"gensim is not installed ({exc}); pip install gensim, or on a machine without network "
                f"carry its wheel (pip download gensim --only-binary=:all: --no-deps)")
    return None


def _speedswap(corpus: Corpus, size: dict, backend: str, seed: int, *, batch_scale: int = 1,
               cache_fraction: float = 0.0, **options) -> dict:
    """One :func:`word2vec.train` run of the demo's job; its words/s and quality."""
    threads = torch.get_num_threads()
    if backend == "numpy":
        torch.set_num_threads(word2vec.cpu_threads())
    try:
        result = word2vec.train(corpus, dim=size["dim"], epochs=size["epochs"],
                                batch_size=batch_scale * size["batch_size"], window=_WINDOW,
                                negatives=_NEGATIVES, subsample=_SUBSAMPLE, backend=backend,
                                storage="pageable" if backend == "numpy" else "pinned",
                                cache_rows=int(cache_fraction * corpus.vocab_size), seed=seed, progress=False,
                                **options)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    purity, chance = word2vec.topic_purity(result.vectors, corpus)
    return {"words_per_second": result.words_per_second, "seconds": result.seconds, "steps": result.steps,
            "topic_purity": purity, "chance": chance, "final_loss": result.losses[-1][1], "torch_threads": used,
            "autograd": result.autograd}


def _gensim_sentences(corpus: Corpus) -> tuple:
    """The corpus as gensim reads it: a list of documents of word strings, and the vocabulary."""
    words = [str(i) for i in range(corpus.vocab_size)]
    tokens = corpus.tokens.tolist()
    bounds = list(corpus.doc_starts) + [len(tokens)]
    return [[words[t] for t in tokens[a:b]] for a, b in zip(bounds[:-1], bounds[1:]) if b > a], words


def _gensim(corpus: Corpus, size: dict, sentences: list, words: list, seed: int) -> dict:
    """One gensim ``Word2Vec(sg=1)`` run with the demo's settings, all cores; its words/s and quality."""
    import gensim
    from gensim.models import Word2Vec

    model = Word2Vec(sg=1, vector_size=size["dim"], window=_WINDOW, negative=_NEGATIVES, sample=_SUBSAMPLE,
                     min_count=1, workers=word2vec.cores_granted(), seed=seed)
    model.build_vocab(sentences)
    start = time.perf_counter()
    model.train(sentences, total_examples=model.corpus_count, epochs=size["epochs"])
    seconds = time.perf_counter() - start
    # A word the corpus never uses is not in gensim's vocabulary: its row stays zero, and topic
    # purity, which scores frequent words only, never reads it.
    vectors = np.zeros((corpus.vocab_size, size["dim"]), dtype=np.float32)
    used = np.flatnonzero(corpus.counts)
    vectors[used] = model.wv[[words[i] for i in used]]
    purity, _ = word2vec.topic_purity(vectors, corpus)
    return {"words_per_second": len(corpus.tokens) * size["epochs"] / seconds, "seconds": seconds,
            "topic_purity": purity, "workers": word2vec.cores_granted(), "gensim": gensim.__version__}


def run(size: dict, rounds: int, *, gpu: bool, gensim: bool = True, seed: int = 0) -> dict:
    """Time the demo's word2vec job on this machine's CPU, its GPU (``gpu``) and, when installed, in gensim.

    Args:
        size: the corpus and run, as :data:`speedswap.apps.demo.DEMO`.
        rounds: runs of each contender (the median is reported).
        gpu: run the GPU contenders (needs the cuda backend).
        gensim: run gensim's contender when gensim is installed.
        seed: seeds the corpus and every run.

    Returns:
        ``{"setup", "contenders": [{"name", "words_per_second" (median), "runs", ...}], "ratios",
        "skipped", "failures"}``; ``ratios`` holds each GPU contender's words/s over the CPU's and
        over gensim's. A GPU or gensim contender that raises is dropped from the later rounds and
        listed in ``skipped`` (its traceback in ``failures``); the others still run.

    Raises:
        Exception: whatever the CPU contender raised (every ratio needs it).
    """
    corpus = synthetic_corpus(size["vocab"], size["topics"], size["tokens"], seed=seed)
    jobs = {"cpu": lambda: _speedswap(corpus, size, "numpy", seed)}
    skipped = {}
    if gpu:
        jobs.update({name: (lambda options=options: _speedswap(corpus, size, "cuda", seed, **options))
                     for name, options in GPU_CONTENDERS.items()})
    else:
        skipped["gpu"] = "no GPU contender in this run"
    why = gensim_missing() if gensim else "not asked for"
    if why is None:
        sentences, words = _gensim_sentences(corpus)
        jobs["gensim"] = lambda: _gensim(corpus, size, sentences, words, seed)
    else:
        skipped["gensim"] = why
    runs = {name: [] for name in jobs}
    names, failures = list(jobs), {}
    for round_ in range(rounds):
        shift = round_ % len(names)  # rotate who goes first, as benchmarks/ does
        for name in names[shift:] + names[:shift]:
            if name in failures:
                continue
            try:
                runs[name].append({**jobs[name](), "load_average": load_average()})
            except Exception as exc:  # noqa: BLE001 -- a contender's error must not lose the others' runs
                if name == "cpu":
                    raise  # every ratio is taken against it
                failures[name] = traceback.format_exc()
                skipped[name] = f"failed in round {round_ + 1}: {type(exc).__name__}: {exc}"
                del runs[name]
    contenders = [{"name": name, "words_per_second": statistics.median(r["words_per_second"] for r in done),
                   "topic_purity": statistics.median(r["topic_purity"] for r in done), "runs": done}
                  for name, done in runs.items()]
    speed = {c["name"]: c["words_per_second"] for c in contenders}
    ratios = {name: {"over_cpu": speed[name] / speed["cpu"],
                     "over_gensim": speed[name] / speed["gensim"] if "gensim" in speed else None}
              for name in speed if name.startswith("gpu")}
    return {"setup": {**{k: size[k] for k in ("vocab", "tokens", "dim", "epochs", "batch_size")},
                      "window": _WINDOW, "negatives": _NEGATIVES, "subsample": _SUBSAMPLE, "rounds": rounds,
                      "cores": word2vec.cores_granted(), "chance": runs["cpu"][0]["chance"]},
            "contenders": contenders, "ratios": ratios, "skipped": skipped, "failures": failures,
            "targets": {"gpu_over_cpu": CPU_TARGET, "gpu_over_gensim": GENSIM_TARGET}}


def format_results(payload: dict) -> str:
    """:func:`run`'s figures as a text table."""
    setup = payload["setup"]
    rows = [{"contender": c["name"], "words/s (median)": round(c["words_per_second"]), "topic purity": c["topic_purity"],
             "x cpu": payload["ratios"].get(c["name"], {}).get("over_cpu"),
             "x gensim": payload["ratios"].get(c["name"], {}).get("over_gensim"), "runs": len(c["runs"])}
            for c in payload["contenders"]]
    lines = [f"word2vec demo job: vocab {setup['vocab']:,}, {setup['tokens']:,} tokens, dim {setup['dim']}, "
             f"{setup['epochs']} epoch(s), batch {setup['batch_size']}, {setup['cores']} cores; "
             f"topic purity chance {setup['chance']:.3f}", format_table(rows, list(rows[0]))]
    lines += [f"{name} skipped: {why}" for name, why in payload["skipped"].items()]
    return "\n".join(lines)
