"""word2vec quality and CPU speed on real English text: speedswap's examples/word2vec.py against gensim.

Corpus: the reStructuredText sources of two Debian documentation packages,
``linux-doc-6.1`` (the Linux kernel's Documentation/, translations left out)
and ``python3.11-doc`` (the Python 3.11 manuals), fetched with
``apt-get download`` (Debian bookworm) at the versions every recorded run
used (:data:`PACKAGES`: a point release can change the text, and a stale
or newer apt list would otherwise fetch another corpus without a word),
unpacked with ``dpkg-deb -x``, lower-cased, cut into words ``[a-z]+``, one
paragraph (a run of non-blank lines) per line. The package versions and
the corpus's SHA-256 go into the results. Evaluation:
gensim's own ``wordsim353.tsv`` and ``questions-words.txt``
(``gensim/test/test_data``), scored with speedswap's reader and with gensim's
``KeyedVectors.evaluate_*`` (which also proves gensim loads the saved file).

Each round runs gensim ``Word2Vec(sg=1)`` and then each speedswap recipe, each
in its own process with the same thread count, so a busy machine weighs on
both alike; the load average is recorded before and after each run.

    pip install gensim==4.4.0
    python benchmarks/word2vec_quality.py --epochs 5 --threads 2 --rounds 1 --recipes sgd,adam

On a GPU machine (``--device cuda``) speedswap trains on the GPU and gensim
uses ``--threads`` of the machine's cores: the word2vec issue's GPU target.
Without network there, carry gensim's wheel and the corpus (benchmarks/README.md).

Needs apt-get (Debian) for the corpus, or ``--corpus FILE`` for another one.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, add_out_option, positive_int, write_results

from speedswap.apps.demo import DEMO

#: The packages at the versions of the recorded corpus (benchmarks/README.md: sha256 36f3d691...).
PACKAGES = ("linux-doc-6.1=6.1.192-2", "python3.11-doc=3.11.2-6+deb12u9")
TOKEN = re.compile(r"[a-z]+")
GENSIM_RUN = r"""
import json, sys, time
from gensim.models import Word2Vec
from gensim.models.word2vec import LineSentence
corpus, out, epochs, threads, seed, wordsim, analogies = sys.argv[1:8]
start = time.perf_counter()
model = Word2Vec(sg=1, vector_size=100, window=5, negative=5, sample=1e-3, min_count=5,
                 workers=int(threads), seed=int(seed))
model.build_vocab(LineSentence(corpus))
vocab_seconds = time.perf_counter() - start
words = sum(model.wv.get_vecattr(w, "count") for w in model.wv.index_to_key)
start = time.perf_counter()
model.train(LineSentence(corpus), total_examples=model.corpus_count, epochs=int(epochs))
seconds = time.perf_counter() - start
model.wv.save_word2vec_format(out)
pearson, spearman, _ = model.wv.evaluate_word_pairs(wordsim)
analogy, _ = model.wv.evaluate_word_analogies(analogies)
print(json.dumps({"seconds": seconds, "vocab_seconds": vocab_seconds, "vocab": len(model.wv),
                  "words_per_second": words * int(epochs) / seconds,
                  "gensim_wordsim": spearman.statistic, "gensim_analogy": analogy}))
"""


def assemble_corpus(directory: Path) -> dict:
    """Download, unpack and tokenise the packages into ``directory/corpus.txt`` (once); describe it."""
    text = directory / "corpus.txt"
    debs = directory / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    if not list(debs.glob("*.deb")):
        if subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs).returncode:
            sys.exit(f"apt-get could not download {' '.join(PACKAGES)}, the recorded corpus's packages: "
                     "run apt-get update if its lists are stale; if Debian no longer serves these versions, "
                     "pass --corpus FILE (the figures in benchmarks/README.md are for this corpus only)")
    versions = sorted(p.name for p in debs.glob("*.deb"))
    if not text.exists():
        tmp = text.with_suffix(".tmp")
        with open(tmp, "w") as out:
            for deb in sorted(debs.glob("*.deb")):
                unpacked = directory / "unpacked" / deb.stem
                unpacked.mkdir(parents=True, exist_ok=True)
                subprocess.run(["dpkg-deb", "-x", deb, unpacked], check=True)
                # Each file once, however many symlinked directories lead to it.
                sources = sorted({p.resolve() for p in unpacked.rglob("*.txt")
                                  if "_sources" in p.parts and "translations" not in p.parts})
                for source in sources:
                    paragraphs = re.split(r"\n\s*\n", source.read_text(encoding="utf-8", errors="replace"))
                    for paragraph in paragraphs:
                        words = TOKEN.findall(paragraph.lower())
                        if len(words) > 1:
                            out.write(" ".join(words) + "\n")
        tmp.rename(text)
    digest = hashlib.sha256(text.read_bytes()).hexdigest()
    return {"path": str(text), "packages": versions, "sha256": digest,
            "tokens": sum(len(line.split()) for line in open(text))}


def loadavg() -> float:
    return os.getloadavg()[0]


def run_gensim(args, corpus, files, out_dir) -> dict:
    before = loadavg()
    done = subprocess.run([sys.executable, "-c", GENSIM_RUN, corpus, out_dir / "gensim.txt", str(args.epochs),
                           str(args.threads), str(args.seed), files["wordsim"], files["analogies"]],
                          capture_output=True, text=True, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures.update(load_before=before, load_after=loadavg())
    figures.update(score_with_speedswap(out_dir / "gensim.txt", files))
    return figures


def run_speedswap(args, recipe, corpus, files, out_dir) -> dict:
    out = out_dir / f"speedswap-{recipe}.txt"
    figures_path = out_dir / f"speedswap-{recipe}.json"
    # Pinned tables on a GPU (what the cuda backend reads rows from); on a CPU pinning buys nothing.
    storage = "pageable" if args.device == "cpu" else "pinned"
    command = [sys.executable, ROOT / "examples" / "word2vec.py", "--corpus", corpus, "--device", args.device,
               "--epochs", str(args.epochs), "--min-count", "5", "--dim", "100", "--window", "5",
               "--negatives", "5", "--subsample", "1e-3", "--optimizer", recipe,
               "--threads", str(args.threads), "--batch-size", str(args.batch_size), "--storage", storage,
               "--seed", str(args.seed), "--wordsim", files["wordsim"], "--analogies", files["analogies"],
               "--save", out, "--json", figures_path, "--quiet"]
    # This checkout's speedswap, and --threads alone deciding the thread count.
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "PYTHONPATH": str(ROOT)}
    before = loadavg()
    subprocess.run(list(map(str, command)), check=True, env=env, stdout=subprocess.DEVNULL)
    figures = json.loads(figures_path.read_text())
    result = {"seconds": figures["seconds"], "words_per_second": figures["words_per_second"],
              "wordsim": figures["wordsim_spearman"], "analogy": figures["analogy_accuracy"],
              "load_before": before, "load_after": loadavg()}
    from gensim.models import KeyedVectors  # the saved file must load in gensim

    vectors = KeyedVectors.load_word2vec_format(str(out))
    result["gensim_wordsim"] = vectors.evaluate_word_pairs(files["wordsim"])[1].statistic
    result["gensim_analogy"] = vectors.evaluate_word_analogies(files["analogies"])[0]
    return result


def score_with_speedswap(path, files) -> dict:
    sys.path.insert(0, str(ROOT))
    from speedswap.apps import evaluate
    from speedswap.apps.w2v_format import load_word2vec_format

    words, vectors = load_word2vec_format(path)
    return {"wordsim": evaluate.word_similarity(vectors, words, evaluate.read_word_pairs(files["wordsim"])).value,
            "analogy": evaluate.analogy_accuracy(vectors, words, evaluate.read_analogies(files["analogies"])).value}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--corpus", help="a text file instead of the assembled Debian corpus")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "speedswap-w2v-corpus"),
                        help="where the packages and the assembled corpus are kept")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--rounds", type=positive_int, default=1, help="gensim + recipes, interleaved")
    parser.add_argument("--recipes", default="sgd,adam", help="speedswap optimizers to run")
    parser.add_argument("--batch-size", type=positive_int, default=DEMO["batch_size"], help="pairs per step (the example's default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--corpus-only", action="store_true",
                        help="assemble the corpus into --cache, print where it is, and stop")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where speedswap trains (gensim always runs on the CPU, with --threads workers)")
    add_out_option(parser)
    args = parser.parse_args()
    if args.corpus_only:
        print(assemble_corpus(Path(args.cache))["path"])
        return
    import gensim

    data = Path(gensim.__file__).parent / "test" / "test_data"
    files = {"wordsim": str(data / "wordsim353.tsv"), "analogies": str(data / "questions-words.txt")}
    corpus = ({"path": args.corpus} if args.corpus else assemble_corpus(Path(args.cache)))
    print(f"corpus: {json.dumps(corpus)}", flush=True)
    out_dir = Path(tempfile.mkdtemp(prefix="w2v-quality-"))
    runs = []
    for round_ in range(args.rounds):
        contenders = [("gensim", lambda: run_gensim(args, corpus["path"], files, out_dir))]
        contenders += [(f"speedswap {r}", lambda r=r: run_speedswap(args, r, corpus["path"], files, out_dir))
                       for r in args.recipes.split(",")]
        for name, run in contenders:
            figures = {"system": name, "round": round_, **run()}
            runs.append(figures)
            print(f"{name:<16} WordSim353 {figures['wordsim']:.3f} (gensim's scorer {figures['gensim_wordsim']:.3f})"
                  f"  analogy {100 * figures['analogy']:.1f}% ({100 * figures['gensim_analogy']:.1f}%)"
                  f"  {figures['words_per_second']:,.0f} words/s  {figures['seconds']:.0f} s"
                  f"  load {figures['load_before']:.1f}->{figures['load_after']:.1f}", flush=True)
    write_results("word2vec_quality", out=args.out, payload={"corpus": corpus, "gensim": gensim.__version__, "epochs": args.epochs,
                                       "threads": args.threads, "batch_size": args.batch_size, "seed": args.seed,
                                       "device": args.device,
                                       "runs": runs})


if __name__ == "__main__":
    main()
