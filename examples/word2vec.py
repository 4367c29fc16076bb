"""word2vec (skip-gram, negative sampling) with both embedding tables and Adam's state offloaded.

Both tables (centre and context vectors, ``--vocab x --dim`` each) and the
optimizer's two moment tables per table live in host memory (``--storage``);
each step moves only the rows its words touch to the device and writes them
back after ``optimizer.step()``. The optimizer is a dense one (Adam or
Adamax): training a sparse model with it was SpeedTorch's point, and is
exact here, repeated words included.

Usage::

    python examples/word2vec.py                              # synthetic corpus, planted topics
    python examples/word2vec.py --corpus text8 --vocab 71290 --steps 20000
    python examples/word2vec.py --vocab 20000000 --storage mmap --table-dir /data/w2v   # > RAM
    python examples/word2vec.py --speedtorch-api             # ModelFactory / OptimizerFactory
    torchrun --nproc-per-node 2 examples/word2vec.py --distributed   # tables sharded over 2 ranks

Without ``--corpus`` the corpus is synthetic: every word belongs to one of
``--topics`` topics, documents are drawn from one topic each with Zipf word
frequencies, so the vectors can be scored: the share of each frequent word's
nearest neighbours from its own topic (topic purity), against the chance
level. With a real corpus (text8: http://mattmahoney.net/dc/text8.zip,
unzipped) the nearest neighbours of a few frequent words are printed instead.

The training loop is :func:`speedswap.apps.word2vec.train`, shared with
``python -m speedswap demo``.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import speedswap as ss
from speedswap.apps import word2vec
from speedswap.apps.corpus import read_text_corpus, synthetic_corpus
from speedswap.apps.demo import DEMO, format_bytes, format_rows, memory_summary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import HelpFormatter, add_common_arguments, backend_and_device, write_json  # noqa: E402


def show_neighbours(vectors, corpus, query_ids, k=8):
    """Print each query word's nearest neighbours among the 10,000 most frequent words."""
    candidates = np.argsort(-corpus.counts, kind="stable")[:10_000]
    for word, row in zip(query_ids, word2vec.nearest_neighbours(vectors, query_ids, candidates, k)):
        print(f"  {corpus.name(word):>14}: {', '.join(corpus.name(n) for n in row)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--corpus", metavar="PATH", help="a text8-style file: whitespace-separated "
                        "words, one document per line (default: synthetic)")
    # The defaults are the demo's size (about a minute on a 2-core CPU).
    parser.add_argument("--vocab", type=int, default=DEMO["vocab"], help="vocabulary size (table rows)")
    parser.add_argument("--topics", type=int, default=DEMO["topics"], help="synthetic topics")
    parser.add_argument("--tokens", type=int, default=DEMO["tokens"], help="synthetic corpus length")
    parser.add_argument("--dim", type=int, default=DEMO["dim"], help="vector length")
    parser.add_argument("--steps", type=int, default=DEMO["steps"], help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=DEMO["batch_size"],
                        help="(centre, context) pairs per step")
    parser.add_argument("--negatives", type=int, default=5, help="negative words per pair")
    parser.add_argument("--window", type=int, default=4, help="largest context reach")
    parser.add_argument("--subsample", type=float, default=1e-3, help="frequent-word subsampling threshold")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate")
    parser.add_argument("--optimizer", choices=("adam", "adamax"), default="adam",
                        help="a dense optimizer, its state offloaded with the tables")
    parser.add_argument("--storage", default="pinned", choices=ss.STORAGE_KINDS,
                        help="where tables and optimizer state live (mmap: files, for more than RAM)")
    parser.add_argument("--table-dir", help="directory for --storage mmap's files")
    parser.add_argument("--speedtorch-api", action="store_true",
                        help="train through ModelFactory/OptimizerFactory instead of OffloadedEmbedding")
    parser.add_argument("--distributed", action="store_true",
                        help="run under torchrun: tables row-sharded over the ranks (docs/distributed.md)")
    parser.add_argument("--save", metavar="PATH", help="save the trained centre vectors (.npy)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.storage == "mmap" and not args.table_dir:
        parser.error("--storage mmap keeps the tables in files: give --table-dir DIR")
    backend, _ = backend_and_device(args)

    start = time.perf_counter()
    if args.corpus:
        corpus = read_text_corpus(args.corpus, args.vocab)
    else:
        corpus = synthetic_corpus(args.vocab, args.topics, args.tokens, seed=args.seed)
    print(f"corpus: {len(corpus.tokens):,} tokens, vocabulary {corpus.vocab_size:,} "
          f"({'synthetic, ' + str(args.topics) + ' topics' if corpus.topics is not None else args.corpus}), "
          f"ready in {time.perf_counter() - start:.1f} s")
    if args.distributed:
        from _distributed import word2vec_sharded
        figures = word2vec_sharded(args, corpus, backend)
        if figures is not None:
            write_json(args, figures)
        return figures

    result = word2vec.train(corpus, dim=args.dim, steps=args.steps, batch_size=args.batch_size,
                            negatives=args.negatives, window=args.window, subsample=args.subsample,
                            lr=args.lr, optimizer=args.optimizer, storage=args.storage, backend=backend,
                            directory=args.table_dir, speedtorch_api=args.speedtorch_api,
                            seed=args.seed, progress=not args.quiet)
    memory = memory_summary(result.model, result.optimizer)
    figures = {"words_per_second": result.words_per_second, "pairs_per_second": result.pairs / result.seconds,
               "seconds": result.seconds, "losses": result.losses, "memory": memory,
               "api": "speedtorch" if args.speedtorch_api else "OffloadedEmbedding"}
    rows = [("API", figures["api"]),
            ("words/s", f"{result.words_per_second:,.0f}  ({figures['pairs_per_second']:,.0f} pairs/s)"),
            ("loss", f"{result.losses[0][1]:.3f} -> {result.losses[-1][1]:.3f}")]
    if corpus.topics is not None:
        purity, chance = word2vec.topic_purity(result.vectors, corpus)
        figures.update(topic_purity=purity, chance=chance)
        rows.append(("topic purity", f"{purity:.3f}  (chance {chance:.3f})"))
    rows += [("host tables", f"{format_bytes(memory['host_bytes'] + memory['file_bytes'])} ({args.storage})"),
             (f"on {memory['device']} for the step", format_bytes(memory["device_bytes"]))]
    print(format_rows(rows))
    print("nearest neighbours:")
    ranked = np.argsort(-corpus.counts, kind="stable")
    show_neighbours(result.vectors, corpus, ranked[[r for r in (0, 10, 100, 1000) if r < len(ranked)]])
    if args.save:
        np.save(args.save, result.vectors)
    write_json(args, figures)
    return figures


if __name__ == "__main__":
    main()
