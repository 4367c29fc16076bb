"""word2vec (skip-gram, negative sampling) with both embedding tables, and any optimizer state, offloaded.

Both tables (centre and context vectors, ``vocabulary x --dim`` each) and the
optimizer's state tables live in host memory (``--storage``); each step moves
only the rows its words touch to the device and writes them back after
``optimizer.step()``. The default recipe is word2vec's own: plain SGD at 0.025
per (centre, context) pair, decayed linearly to ~0 over the run. ``--optimizer
adam`` or ``adamax`` trains with a dense optimizer instead (SpeedTorch's point),
exact here, repeated words included, its state offloaded with the tables.

Usage::

    python examples/word2vec.py                              # synthetic corpus, planted topics
    python examples/word2vec.py --corpus text8 --epochs 5 --min-count 5 --dim 100 \
        --wordsim wordsim353.tsv --analogies questions-words.txt --save vectors.txt
    python examples/word2vec.py --vocab 20000000 --storage mmap --table-dir /data/w2v   # > RAM
    python examples/word2vec.py --speedtorch-api             # ModelFactory / OptimizerFactory
    torchrun --nproc-per-node 2 examples/word2vec.py --distributed   # tables sharded over 2 ranks

Without ``--corpus`` the corpus is synthetic: every word belongs to one of
``--topics`` topics, documents are drawn from one topic each with Zipf word
frequencies, so the vectors can be scored: the share of each frequent word's
nearest neighbours from its own topic (topic purity), against the chance
level. With a real corpus (text8: http://mattmahoney.net/dc/text8.zip,
unzipped; one document per line) the vocabulary is every word seen
``--min-count`` times, the nearest neighbours of a few frequent words are
printed, and ``--wordsim``/``--analogies`` score the vectors on the files
gensim ships (``gensim/test/test_data/wordsim353.tsv``, ``questions-words.txt``).

``--save`` writes word2vec's text format (``--binary``: its binary format),
which gensim's ``KeyedVectors.load_word2vec_format`` reads; a ``.npy`` path
gets the bare array. On a CPU the run's thread budget is ``--threads``, else
``OMP_NUM_THREADS``, else every core this process may use: one thread makes
pairs and negatives, torch gets the rest (at least one).

The training loop is :func:`speedswap.apps.word2vec.train`, shared with
``python -m speedswap demo``.
"""

import os

# Idle OpenMP threads sleep instead of spinning: on a CPU shared with other
# jobs, spinning threads steal the cores the working ones wait for, and two
# threads ran slower than one. Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import speedswap as ss  # noqa: E402
from speedswap.apps import evaluate, word2vec  # noqa: E402
from speedswap.apps.corpus import read_text_corpus, synthetic_corpus  # noqa: E402
from speedswap.apps.demo import (DEMO, cache_summary, format_cache, format_rows,  # noqa: E402
                                 memory_summary)
from speedswap.apps.w2v_format import save_word2vec_format  # noqa: E402
from speedswap.atomic import atomic_output  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (HelpFormatter, add_common_arguments, backend_and_device, check_torchrun,  # noqa: E402
                     existing_file, memory_rows, nonnegative_float, nonnegative_int, positive_float, positive_int,
                     run, table_directory, writable_file, write_json)
from _distributed import STEPS, word2vec_sharded  # noqa: E402


def show_neighbours(vectors, corpus, query_ids, k=8):
    """Print each query word's nearest neighbours among the 10,000 most frequent words (the queries among them)."""
    candidates = np.argsort(-corpus.counts, kind="stable")[:10_000]
    k = min(k, len(candidates) - 1)  # a vocabulary of k words or fewer has fewer neighbours to show
    for word, row in zip(query_ids, word2vec.nearest_neighbours(vectors, query_ids, candidates, k)):
        print(f"  {corpus.name(word):>14}: {', '.join(corpus.name(n) for n in row)}")


#: --min-count's default, as word2vec's and gensim's.
MIN_COUNT = 5


def add_corpus_arguments(parser):
    """The corpus and its vocabulary."""
    group = parser.add_argument_group("corpus")
    group.add_argument("--corpus", metavar="PATH", type=existing_file,
                       help="a text8-style file: whitespace-separated "
                       "words, one document per line (default: synthetic)")
    group.add_argument("--min-count", type=positive_int,
                       help="with --corpus: keep words seen at least this often, as word2vec does (default: "
                       f"{MIN_COUNT})")
    group.add_argument("--vocab", type=positive_int, help="synthetic: the vocabulary size; with --corpus: keep at "
                       f"most this many most frequent words (default: {DEMO['vocab']} synthetic, no cap "
                       "for a corpus)")
    group.add_argument("--topics", type=positive_int, help=f"synthetic topics (default: {DEMO['topics']})")
    group.add_argument("--tokens", type=positive_int,
                       help=f"synthetic corpus length (default: {DEMO['tokens']:,})")


def add_training_arguments(parser):
    """The model and the recipe; the defaults are the demo's size (about a minute on a 2-core CPU)."""
    group = parser.add_argument_group("training")
    group.add_argument("--dim", type=positive_int, default=DEMO["dim"], help="vector length")
    group.add_argument("--epochs", type=positive_int,
                       help=f"passes over the corpus (default: {DEMO['epochs']}; --distributed counts --steps)")
    group.add_argument("--steps", type=positive_int,
                       help=f"optimizer steps instead of --epochs (default with --distributed: {STEPS})")
    group.add_argument("--batch-size", type=positive_int, default=DEMO["batch_size"],
                       help="(centre, context) pairs per step")
    group.add_argument("--negatives", type=nonnegative_int, default=5, help="negative words per pair")
    group.add_argument("--window", type=positive_int, default=5, help="largest context reach")
    group.add_argument("--subsample", type=nonnegative_float, default=1e-3,
                       help="frequent-word subsampling threshold (0: keep every word)")
    group.add_argument("--optimizer", choices=sorted(word2vec.DEFAULT_LR), default="sgd",
                       help="sgd: word2vec's recipe; adam/adamax: dense optimizers, state offloaded")
    group.add_argument("--lr", type=positive_float, help="learning rate; for sgd the step size per pair (the loss "
                       "is summed over a batch, never averaged) (default: "
                       + ", ".join(f"{k} {v}" for k, v in word2vec.DEFAULT_LR.items()) + ")")
    group.add_argument("--schedule", choices=("linear", "constant"),
                       help="linear: decay to lr*1e-4 over the run, as word2vec does (default: linear; "
                       "--distributed: constant)")
    group.add_argument("--threads", type=positive_int, help="CPU threads, like gensim's workers: one makes pairs, "
                       "torch gets the rest (default: OMP_NUM_THREADS, else every core this process may use)")
    group.add_argument("--storage", default="pinned", choices=ss.STORAGE_KINDS,
                       help="where tables and optimizer state live (mmap: files, for more than RAM)")
    group.add_argument("--table-dir", type=table_directory,
                       help="a new or empty directory for --storage mmap's files")
    group.add_argument("--speedtorch-api", action="store_true",
                       help="train through ModelFactory/OptimizerFactory instead of OffloadedEmbedding")
    gradients = group.add_mutually_exclusive_group()
    gradients.add_argument("--autograd", action="store_true",
                           help="differentiate with autograd (the default for adam, adamax and on a GPU) "
                           "instead of skip-gram's closed-form gradients (the default for sgd on the CPU; "
                           "the same vectors to float32 rounding)")
    gradients.add_argument("--closed-form", action="store_true",
                           help="skip-gram's closed-form gradients where autograd is the default (on a GPU, "
                           "or with adam/adamax)")
    group.add_argument("--cache-rows", type=nonnegative_int, default=0, metavar="N",
                       help="keep N hot rows of each table (and their optimizer state) on the device "
                       "between steps (0: no cache)")
    group.add_argument("--prefetch", action="store_true",
                       help="with --cache-rows: bring the next batch's rows in while a step computes")
    group.add_argument("--distributed", action="store_true",
                       help="run under torchrun: tables row-sharded over the ranks (README: 'Several "
                       "processes and machines')")


def add_output_arguments(parser):
    """Evaluation and the saved vectors."""
    group = parser.add_argument_group("evaluation and output")
    group.add_argument("--wordsim", metavar="PATH", type=existing_file,
                       help="score word similarity (WordSim353's format)")
    group.add_argument("--analogies", metavar="PATH", type=existing_file,
                       help="score analogies (questions-words.txt's format)")
    group.add_argument("--save", metavar="PATH", type=writable_file,
                       help="save the centre vectors: word2vec's text format, or a bare numpy array for a .npy path")
    group.add_argument("--binary", action="store_true", help="--save in word2vec's binary format")
    group.add_argument("--quiet", action="store_true", help="no progress bar")


def evaluate_vectors(args, vectors, corpus):
    """``[(label, value)]`` rows and figures for ``--wordsim``/``--analogies``."""
    rows, figures = [], {}
    words = [corpus.name(i) for i in range(corpus.vocab_size)]
    if args.wordsim:
        score = evaluate.word_similarity(vectors, words, evaluate.read_word_pairs(args.wordsim))
        figures["wordsim_spearman"], figures["wordsim_pairs"] = score.value, score.used
        rows.append(("word similarity", f"Spearman {score.value:.3f}  ({score.used} of {score.total} "
                                        f"pairs in the vocabulary)"))
    if args.analogies:
        score = evaluate.analogy_accuracy(vectors, words, evaluate.read_analogies(args.analogies))
        figures["analogy_accuracy"], figures["analogy_questions"] = score.value, score.used
        rows.append(("analogies", f"{100 * score.value:.1f}% solved  ({score.used} of {score.total} "
                                  f"questions in the vocabulary)"))
    return rows, figures


def save_vectors(args, vectors, corpus):
    """``--save``: word2vec's text (or ``--binary``) format, or the bare array for a ``.npy`` path."""
    if args.save and args.save.endswith(".npy"):
        # Atomically, as the word2vec formats are: a failed write (a full disk) leaves any old file whole.
        with atomic_output(args.save) as tmp, open(tmp, "wb") as f:
            np.save(f, vectors)
    elif args.save:
        save_word2vec_format(args.save, [corpus.name(i) for i in range(corpus.vocab_size)], vectors,
                             binary=args.binary)


#: What the sharded run of ``--distributed`` does not do, as (option given, why).
NOT_DISTRIBUTED = (
    ("--speedtorch-api", lambda args: args.speedtorch_api, "it trains ShardedOffloadedEmbedding tables"),
    ("--epochs", lambda args: args.epochs is not None, f"it counts --steps (default {STEPS})"),
    ("--schedule linear", lambda args: args.schedule == "linear", "it keeps the learning rate constant"),
    ("--cache-rows", lambda args: args.cache_rows, "its sharded tables have no device cache"),
    ("--closed-form", lambda args: args.closed_form, "it trains with autograd"),
)


def check_options(parser, args):
    """Options that contradict each other, or that the chosen mode would ignore: argparse's one-line error."""
    synthetic_only = [name for name, value in (("--topics", args.topics), ("--tokens", args.tokens))
                      if value is not None]
    if args.corpus and synthetic_only:
        verb = "shape" if len(synthetic_only) > 1 else "shapes"
        parser.error(f"{' and '.join(synthetic_only)} {verb} the synthetic corpus, which --corpus replaces: "
                     f"drop {' and '.join(synthetic_only)}")
    if not args.corpus and args.min_count is not None:
        parser.error("--min-count filters the words of a --corpus; the synthetic corpus keeps its whole "
                     "--vocab: drop --min-count, or give --corpus")
    if args.storage == "mmap" and not args.table_dir:
        parser.error("--storage mmap keeps the tables in files: give --table-dir DIR")
    if args.table_dir and args.storage != "mmap":
        parser.error(f"--table-dir is where --storage mmap puts its files; --storage {args.storage} makes none")
    if args.prefetch and not args.cache_rows:
        parser.error("--prefetch brings rows into the device cache: give --cache-rows N as well")
    if args.closed_form and args.speedtorch_api:
        parser.error("--speedtorch-api trains with autograd: drop --closed-form")
    if args.epochs is not None and args.steps is not None:
        parser.error("give the run's length as --epochs or as --steps, not both")
    if args.binary and not args.save:
        parser.error("--binary is the format of --save: give --save PATH")
    if args.binary and args.save.endswith(".npy"):
        parser.error("--binary is word2vec's format; a .npy --save path gets the bare array: drop one")
    if args.distributed:
        for option, given, why in NOT_DISTRIBUTED:
            if given(args):
                parser.error(f"--distributed does not take {option}: {why}")
    check_torchrun(parser, args)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    add_corpus_arguments(parser)
    add_training_arguments(parser)
    add_output_arguments(parser)
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    check_options(parser, args)
    backend, device = backend_and_device(args)
    if device.type == "cpu":
        torch.set_num_threads(word2vec.cpu_threads(args.threads))

    start = time.perf_counter()
    if args.corpus:
        try:
            corpus = read_text_corpus(args.corpus, args.vocab,
                                      min_count=MIN_COUNT if args.min_count is None else args.min_count)
        except ss.FileFormatError as exc:  # not UTF-8, no words, none min-count times: the file's fault
            parser.error(f"--corpus: {exc}")
    else:
        vocab = DEMO["vocab"] if args.vocab is None else args.vocab
        args.topics = DEMO["topics"] if args.topics is None else args.topics
        corpus = synthetic_corpus(vocab, args.topics, DEMO["tokens"] if args.tokens is None else args.tokens,
                                  seed=args.seed)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        print(f"corpus: {len(corpus.tokens):,} tokens, vocabulary {corpus.vocab_size:,} "
              f"({'synthetic, ' + str(args.topics) + ' topics' if corpus.topics is not None else args.corpus}), "
              f"ready in {time.perf_counter() - start:.1f} s")
    if args.distributed:
        figures, vectors = word2vec_sharded(args, corpus, backend)
        if figures is None:  # not rank 0
            return None
        quality_rows, quality = evaluate_vectors(args, vectors, corpus)
        figures.update(quality)
        if quality_rows:
            print(format_rows(quality_rows))
        save_vectors(args, vectors, corpus)
        write_json(args, figures)
        return figures

    result = word2vec.train(corpus, dim=args.dim,
                            epochs=(args.epochs or DEMO["epochs"]) if args.steps is None else None,
                            steps=args.steps, batch_size=args.batch_size, negatives=args.negatives,
                            window=args.window, subsample=args.subsample, optimizer=args.optimizer,
                            lr=args.lr, schedule=args.schedule or "linear", storage=args.storage,
                            backend=backend,
                            directory=args.table_dir, speedtorch_api=args.speedtorch_api,
                            autograd=True if args.autograd else False if args.closed_form else None,
                            cache_rows=args.cache_rows,
                            prefetch=args.prefetch, seed=args.seed, progress=not args.quiet)
    memory = memory_summary(result.model, result.optimizer)
    figures = {"words_per_second": result.words_per_second, "pairs_per_second": result.pairs / result.seconds,
               "seconds": result.seconds, "words": result.words, "steps": result.steps,
               "losses": result.losses, "memory": memory, "threads": torch.get_num_threads(),
               "api": "speedtorch" if args.speedtorch_api else "OffloadedEmbedding",
               "gradients": "autograd" if result.autograd else "closed form"}
    rows = [("API", f"{figures['api']}, {args.optimizer} ({figures['gradients']} gradients), {device.type}"
                    + (f" ({figures['threads']} torch threads + 2 making and planning pairs)"
                       if device.type == "cpu" else "")),
            ("training", f"{result.steps:,} steps, {result.words:,} words in {result.seconds:.1f} s"),
            ("words/s", f"{result.words_per_second:,.0f}  ({figures['pairs_per_second']:,.0f} pairs/s)"),
            ("loss per pair", f"{result.losses[0][1]:.3f} -> {result.losses[-1][1]:.3f}")]
    if corpus.topics is not None:
        purity, line = word2vec.purity_report(result.vectors, corpus)
        figures.update(purity)
        rows.append(("topic purity", line))
    quality_rows, quality = evaluate_vectors(args, result.vectors, corpus)
    figures.update(quality)
    rows += quality_rows
    rows += memory_rows(memory, args.storage)
    if args.cache_rows and not args.speedtorch_api:  # the switchers are gone with the run
        figures["cache"] = cache_summary({"centre": result.model.centre, "context": result.model.context})
        rows += format_cache(figures["cache"])
    print(format_rows(rows))
    print("nearest neighbours:")
    ranked = np.argsort(-corpus.counts, kind="stable")
    show_neighbours(result.vectors, corpus, ranked[[r for r in (0, 10, 100, 1000) if r < len(ranked)]])
    save_vectors(args, result.vectors, corpus)
    write_json(args, figures)
    return figures


if __name__ == "__main__":
    run(main)
