"""The examples and the demo run from the command line at tiny sizes and reach their quality figures.

Each example runs in a subprocess exactly as a user would start it, writes its
figures with ``--json``, and the test checks them against what the planted
structure of its synthetic data makes reachable (and what chance or a
trivial predictor would give), so a broken training loop fails here.
"""

import argparse
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.apps import evaluate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(args, tmp_path, timeout=180):
    """Run ``python *args`` from the repository root; returns stdout, failing with its output."""
    # One torch thread per process: the suite may share a small machine with
    # other jobs, and contended OpenMP spinning makes tiny steps 100x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::RuntimeWarning",
           "PYTHONPATH": str(ROOT)}  # this checkout's speedswap, not an installed one
    done = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_example(name, args, tmp_path):
    """Run ``examples/<name>.py`` on the CPU without progress bars; returns (stdout, figures)."""
    figures = tmp_path / f"{name}.json"
    out = run([EXAMPLES / f"{name}.py", "--device", "cpu", "--quiet", "--json", figures, *args], tmp_path)
    return out, json.loads(figures.read_text())


def load_example(name):
    """Import an example file as a module (for its loaders)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_W2V = ["--vocab", "2000", "--topics", "20", "--tokens", "200000", "--dim", "32",
            "--epochs", "2", "--batch-size", "1024"]


@pytest.mark.slow
def test_word2vec_learns_topics_and_both_apis_agree(tmp_path):
    out, offloaded = run_example("word2vec", TINY_W2V + ["--storage", "mmap", "--table-dir", tmp_path / "tables",
                                                         "--save", tmp_path / "offloaded.npy"], tmp_path)
    # Random vectors score the chance level (~0.05 with 20 topics); the planted
    # topics are learned well within two epochs.
    assert offloaded["topic_purity"] > 0.6, out
    assert offloaded["topic_purity"] > 8 * offloaded["chance"], out
    assert offloaded["losses"][-1][1] < 0.7 * offloaded["losses"][0][1]
    assert offloaded["memory"]["file_bytes"] > 0  # mmap tables are files, not RAM
    assert "nearest neighbours" in out

    _, speedtorch = run_example("word2vec", TINY_W2V + ["--storage", "pageable", "--speedtorch-api",
                                                        "--cache-rows", "500", "--prefetch",
                                                        "--save", tmp_path / "speedtorch.npy"], tmp_path)
    # Same seed, same batches: the switcher API (with its device cache) and OffloadedEmbedding
    # train the same vectors.
    np.testing.assert_allclose(np.load(tmp_path / "speedtorch.npy"), np.load(tmp_path / "offloaded.npy"),
                               rtol=0, atol=1e-5)
    assert speedtorch["topic_purity"] == pytest.approx(offloaded["topic_purity"], abs=0.01)


def test_word2vec_closed_form_is_asked_for_where_autograd_is_the_default(tmp_path):
    # Adam defaults to autograd; --closed-form trains it with skip-gram's own gradients.
    out, figures = run_example("word2vec", TINY_W2V + ["--optimizer", "adam", "--closed-form"], tmp_path)
    assert figures["gradients"] == "closed form" and "closed form" in out
    assert figures["topic_purity"] > 8 * figures["chance"], out
    for clash in (["--autograd", "--closed-form"], ["--speedtorch-api", "--closed-form"]):
        done = subprocess.run([sys.executable, EXAMPLES / "word2vec.py", *clash], capture_output=True, text=True)
        assert done.returncode == 2 and "--closed-form" in done.stderr


def write_country_corpus(tmp_path, rng, lines=6000):
    """A small text whose words have real relations: countries, their capitals, languages and rivers.

    Returns the paths of the corpus, a similarity file and an analogy file in
    gensim's formats, built from those relations.
    """
    facts = [("france", "paris", "french", "seine"), ("germany", "berlin", "german", "rhine"),
             ("italy", "rome", "italian", "tiber"), ("spain", "madrid", "spanish", "tagus"),
             ("russia", "moscow", "russian", "volga"), ("egypt", "cairo", "arabic", "nile"),
             ("england", "london", "english", "thames"), ("hungary", "budapest", "hungarian", "danube")]
    templates = ["{1} is the capital of {0}", "people in {0} speak {2}", "the {3} flows through {1} in {0}",
                 "in {1} most people speak {2}", "the river {3} is in {0}", "we flew from {1} to {0} and back"]
    text = [templates[t].format(*facts[f]) for t, f in zip(rng.integers(0, len(templates), lines),
                                                          rng.integers(0, len(facts), lines))]
    (tmp_path / "corpus.txt").write_text("\n".join(text) + "\n")
    # Words of one kind fill the same slots, so they are what skip-gram makes similar. Every pair of
    # facts (224 pairs): with the 52 of neighbouring facts a random vectors' score spread 0.14 wide,
    # and one draw in about a thousand came within the test's 0.3 of the trained one.
    similar = [f"{f[k]}\t{g[k]}\t9.0" for f, g in itertools.combinations(facts, 2) for k in range(4)]
    unrelated = [f"{f[k]}\t{g[(k + 1) % 4]}\t1.0" for f, g in itertools.combinations(facts, 2) for k in range(4)]
    (tmp_path / "ws.tsv").write_text("# Word 1\tWord 2\tHuman (mean)\n" + "\n".join(similar + unrelated) + "\n")
    questions = [f"{f[0]} {f[1]} {g[0]} {g[1]}" for f in facts for g in facts if f != g]
    (tmp_path / "q.txt").write_text(": capital-common-countries\n" + "\n".join(questions) + "\n")
    return tmp_path / "corpus.txt", tmp_path / "ws.tsv", tmp_path / "q.txt"


@pytest.mark.slow
def test_word2vec_on_a_small_text_learns_relations_gensim_can_read(tmp_path, rng):
    corpus, wordsim, analogies = write_country_corpus(tmp_path, rng)
    common = ["--corpus", corpus, "--min-count", "5", "--dim", "24", "--window", "3", "--batch-size", "256",
              "--wordsim", wordsim, "--analogies", analogies]
    _, untrained = run_example("word2vec", common + ["--steps", "1"], tmp_path)
    out, trained = run_example("word2vec", common + ["--epochs", "5", "--save", tmp_path / "vectors.txt"],
                               tmp_path)
    assert "vocabulary 49" in out and trained["words"] == 5 * sum(len(x.split()) for x in open(corpus))
    # Random vectors (what one step from word2vec's initialisation gives) score about zero.
    words = [line.split()[0] for line in open(tmp_path / "vectors.txt")][1:]
    random_vectors = rng.standard_normal((len(words), 24))
    pairs, questions = evaluate.read_word_pairs(wordsim), evaluate.read_analogies(analogies)
    chance = evaluate.word_similarity(random_vectors, words, pairs).value
    assert trained["wordsim_spearman"] > max(untrained["wordsim_spearman"], chance) + 0.3, out
    assert trained["analogy_accuracy"] > 0.3 > evaluate.analogy_accuracy(random_vectors, words, questions).value
    assert trained["losses"][-1][1] < 0.8 * trained["losses"][0][1]
    keyed = pytest.importorskip("gensim.models").KeyedVectors.load_word2vec_format(str(tmp_path / "vectors.txt"))
    assert keyed.evaluate_word_pairs(str(wordsim))[1].statistic == pytest.approx(trained["wordsim_spearman"],
                                                                                 abs=1e-3)


@pytest.mark.slow
def test_demo_tiny(tmp_path):
    out = run(["-m", "speedswap", "demo", "--tiny", "--device", "cpu", "--no-progress"], tmp_path)
    purity, chance = map(float, re.search(r"topic purity\s+([\d.]+)\s+\(chance ([\d.]+)\)", out).groups())
    assert purity > 0.6 and purity > 8 * chance, out
    for label in ("words/s", "host tables", "on cpu for the step", "storage"):
        assert label in out
    assert "cache" not in out
    cached = run(["-m", "speedswap", "demo", "--tiny", "--device", "cpu", "--no-progress", "--cache-rows", "500"],
                 tmp_path)
    # The same vectors with a cache (tests/test_word2vec.py), and its figures from emb.stats().
    assert re.search(r"topic purity\s+([\d.]+)", cached).group(1) == f"{purity:.3f}"
    for table in ("centre", "context"):
        hit_rate = float(re.search(rf"{table} cache\s+500 rows \(.*\): ([\d.]+)% of rows hit", cached).group(1))
        assert 0 < hit_rate < 100, cached


TINY_RECOMMENDER = ["--users", "500", "--items", "300", "--rank", "4", "--count", "40000", "--dim", "4",
                    "--epochs", "8", "--batch-size", "512", "--lr", "0.02"]


@pytest.mark.slow
def test_recommender_reaches_the_noise_and_equals_in_memory_training(tmp_path):
    out, figures = run_example("recommender", TINY_RECOMMENDER, tmp_path)
    offloaded, in_memory = figures["offloaded"][-1], figures["in_memory"][-1]
    assert offloaded["test_rmse"] < 0.6 * figures["baseline_rmse"], out  # well below predicting the mean
    assert offloaded["test_rmse"] < 1.2 * figures["noise"], out          # near the best reachable
    # Offloaded Adam is lazy Adam: it equals SparseAdam on in-memory tables.
    for ours, theirs in zip(figures["offloaded"], figures["in_memory"]):
        assert ours["test_rmse"] == pytest.approx(theirs["test_rmse"], abs=1e-5)
        assert ours["train_rmse"] == pytest.approx(theirs["train_rmse"], abs=1e-5)
    assert figures["max_table_difference"] < 1e-5  # float32 rounding
    assert in_memory["test_rmse"] < 0.6 * figures["baseline_rmse"]


def test_recommender_reads_movielens_formats(tmp_path, rng):
    recommender = load_example("recommender")
    user_ids = rng.choice(np.arange(1, 5000), 40)            # MovieLens ids have gaps
    item_ids = rng.choice(np.arange(1, 90000), 70)
    users, items = rng.choice(user_ids, 500), rng.choice(item_ids, 500)
    stars = rng.integers(1, 6, 500)                          # ml-100k: whole stars
    half_stars = rng.integers(1, 11, 500) / 2                 # ml-latest: half stars
    stamps = rng.integers(8e8, 9e8, 500)
    (tmp_path / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n"
                                             for u, i, r, t in zip(users, items, stars, stamps)))
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "".join(
        f"{u},{i},{r},{t}\n" for u, i, r, t in zip(users, items, half_stars, stamps)))
    for name, expected in (("u.data", stars), ("ratings.csv", half_stars)):
        u, i, r = recommender.read_ratings(tmp_path / name)
        # Dense 0-based ids that keep the original ids' identity and order.
        np.testing.assert_array_equal(np.unique(users)[u], users)
        np.testing.assert_array_equal(np.unique(items)[i], items)
        np.testing.assert_allclose(r, expected)


@pytest.mark.slow
def test_linear_regression_recovers_the_weights(tmp_path):
    out, figures = run_example("linear_regression", [
        "--rows", "20000", "--features", "20", "--epochs", "4", "--batch-size", "512",
        "--order", "block", "--mmap", "--data-dir", tmp_path / "data", "--compare"], tmp_path)
    start = figures["initial_w_distance"]
    for run_name in ("speedswap", "dataloader"):
        distances = [epoch["w_distance"] for epoch in figures[run_name]]
        assert distances[0] < 0.3 * start, out
        assert distances[-1] < 0.15 * start, out
        assert min(distances[1:]) < distances[0], out
    assert "X in storage mmap" in out


def test_linear_regression_says_where_x_is_as_the_demo_does(tmp_path, capsys):
    """On a CPU it printed "speedswap: device X": the DataGadget's storage kind (CPUPinn=False), which
    on the CPU backend is plain host memory, as the demo's closing table says in its words."""
    from speedswap.apps.demo import format_demo
    summary = {"vocab": 2000, "dim": 32, "optimizer": "SGD", "tables": 2, "epochs": 1, "steps": 10,
               "seconds": 1.0, "threads": 1, "final loss": 1.5, "words/s": 10.0, "pairs/s": 20.0,
               "topic purity": 0.9, "chance": 0.05, "storage": "device", "page-locked": False,
               "host_bytes": 1024, "file_bytes": 0, "device": "cpu", "device_bytes": 512}
    demo_says = re.search(r"storage\s+(.+)", format_demo(summary)).group(1).strip()
    assert "plain host memory" in demo_says
    load_example("linear_regression").main(["--device", "cpu", "--quiet", "--rows", "200", "--features", "3",
                                             "--epochs", "1", "--batch-size", "50", "--data-dir",
                                             str(tmp_path / "data")])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("speedswap:")]
    assert line.startswith(f"speedswap: X in storage {demo_says}, "), line


@pytest.mark.slow
def test_logistic_regression_accuracy(tmp_path):
    out, figures = run_example("logistic_regression", [
        "--samples", "20000", "--features", "50", "--informative", "10", "--epochs", "4",
        "--l1", "1e-4", "--l2", "1e-4"], tmp_path)
    # Chance is ~0.3 here and the Bayes-optimal classifier scores ~0.82.
    assert figures["test_accuracy"] > 0.75, out
    assert figures["test_accuracy"] > figures["bayes_accuracy"] - 0.05, out
    assert figures["test_accuracy"] > 2 * figures["chance"]


@pytest.mark.slow
def test_logistic_regression_reads_arrays(tmp_path, rng):
    x = rng.standard_normal((3000, 6)).astype(np.float32) * 5 + 3   # unscaled: the example standardises
    y = np.argmax(x[:, :3], axis=1)                                 # linearly separable classes
    np.save(tmp_path / "X.npy", x)
    np.save(tmp_path / "y.npy", y)
    _, figures = run_example("logistic_regression", ["--x", tmp_path / "X.npy", "--y", tmp_path / "y.npy",
                                                     "--epochs", "10", "--lr", "0.05"], tmp_path)
    assert figures["bayes_accuracy"] is None
    assert figures["test_accuracy"] > 0.9


def _fails(args):
    """Run ``python *args`` expecting failure; returns (return code, stderr)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore::RuntimeWarning", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0, done.stdout
    return done.returncode, done.stderr


def test_logistic_regression_refuses_files_that_would_train_on_wrong_labels(tmp_path, rng):
    np.save(tmp_path / "X.npy", rng.standard_normal((50, 4)))
    np.save(tmp_path / "y40.npy", rng.integers(0, 3, 40))                 # 10 rows of X without a label
    np.save(tmp_path / "yfrac.npy", rng.random(50))                       # 0.3 would have become class 0
    example = EXAMPLES / "logistic_regression.py"
    for y, message in [("y40.npy", "--x has 50 rows and --y has shape \\(40,\\)"),
                       ("yfrac.npy", "--y must hold class ids"), ("missing.npy", "no file at")]:
        code, err = _fails([example, "--device", "cpu", "--x", tmp_path / "X.npy", "--y", tmp_path / y])
        assert code == 2 and re.search(message, err) and "Traceback" not in err, err


def test_examples_and_the_command_line_end_a_speedswap_error_with_its_message(tmp_path):
    np.save(tmp_path / "X.npy", np.arange(6.0))  # the user's own file, not the example's dataset
    code, err = _fails([EXAMPLES / "linear_regression.py", "--device", "cpu", "--rows", "50", "--features", "3",
                        "--data-dir", tmp_path])
    assert code == 1 and "linear_regression.py: error:" in err and "Traceback" not in err, err
    assert "did not make" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.npy"]  # refused before anything was written
    np.testing.assert_array_equal(np.load(tmp_path / "X.npy"), np.arange(6.0))
    if "cuda" not in ss.available_backends():
        code, err = _fails(["-m", "speedswap", "demo", "--device", "cuda"])
        assert code == 2 and "demo: error: torch sees no CUDA device" in err and "Traceback" not in err, err
    assert subprocess.run([sys.executable, "-m", "speedswap", "--version"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip() == f"speedswap {ss.__version__}"


@pytest.mark.slow
def test_bench_quick_writes_results_and_chart(tmp_path):
    pytest.importorskip("matplotlib")
    out = run(["-m", "speedswap", "bench", "--quick", "--repeats", "3", "--out", tmp_path], tmp_path)
    stem = tmp_path / f"transport-bench-{'gpu' if 'cuda' in ss.available_backends() else 'cpu'}"
    assert set(tmp_path.iterdir()) == {stem.with_suffix(".json"), stem.with_suffix(".png")}, out
    result = json.loads(stem.with_suffix(".json").read_text())
    assert result["machine"]["cores"] and result["cpu"]["gather"][0]["method"] == "HostTable.gather"
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The printed table carries the JSON's figures.
    gather = result["cpu"]["gather"][0]
    assert re.search(rf"HostTable\.gather\s+{gather['median_ms']:.4g}\s", out), out


@pytest.mark.parametrize("name", ["word2vec", "recommender", "linear_regression", "logistic_regression"])
def test_example_help_shows_every_default(name, monkeypatch, capsys):
    parsers = []
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, *a, **k: parsers.append(self) or sys.exit(0))
    with pytest.raises(SystemExit):
        load_example(name).main([])
    (parser,) = parsers
    help_text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS):
            assert f"(default: {action.default})" in help_text, action.option_strings


def _refused(name, args, capsys):
    """Run example ``name``'s ``main`` in this process, expecting argparse's one-line error; returns it."""
    with pytest.raises(SystemExit) as exit_info:
        load_example(name).main(["--device", "cpu", *map(str, args)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    return line


ALL_EXAMPLES = ["word2vec", "recommender", "linear_regression", "logistic_regression"]
BAD_ARGUMENTS = [
    *[(name, ["--seed", "-1"], "--seed: '-1' is not a seed") for name in ALL_EXAMPLES],
    *[(name, ["--json", "{tmp}/missing/figures.json"], "--json: no directory") for name in ALL_EXAMPLES],
    ("recommender", ["--json", "{tmp}"], "--json: '.*' is a directory"),
    ("recommender", ["--epochs", "0"], "--epochs: '0' is not a positive integer"),
    ("recommender", ["--users", "0"], "--users: '0' is not a positive integer"),
    ("recommender", ["--rank", "0"], "--rank: '0'"),
    ("recommender", ["--dim", "-2"], "--dim: '-2'"),
    ("recommender", ["--lr", "nan"], "--lr: 'nan' is not a finite number > 0"),
    *[("recommender", ["--test-share", share], f"--test-share: '{share}' is not a share")
      for share in ("nan", "0", "1.5")],
    ("recommender", ["--l2", "nan"], "--l2: 'nan' is not a finite number >= 0"),
    ("recommender", ["--noise", "nan"], "--noise: 'nan'"),
    ("linear_regression", ["--rows", "0", "--data-dir", "{tmp}/data"], "--rows: '0' is not a positive integer"),
    ("linear_regression", ["--rows", "1", "--data-dir", "{tmp}/data"], "--rows must be at least 2"),
    ("linear_regression", ["--batch-size", "0", "--data-dir", "{tmp}/data"], "--batch-size: '0'"),
    ("linear_regression", ["--epochs", "0"], "--epochs: '0'"),
    ("linear_regression", ["--lr", "nan"], "--lr: 'nan'"),
    ("linear_regression", ["--compare", "--max-seconds", "0"], "--max-seconds: '0' is not a finite number > 0"),
    *[("logistic_regression", ["--test-share", share], f"--test-share: '{share}' is not a share")
      for share in ("0", "1.5")],
    ("logistic_regression", ["--val-share", "0.5", "--test-share", "0.5"], "leave no rows to train on"),
    ("logistic_regression", ["--samples", "5"], "5 rows split 5 train / 0 val / 0 test"),
    ("logistic_regression", ["--features", "0"], "--features: '0'"),
    ("logistic_regression", ["--informative", "30", "--features", "20"], "--informative 30 is more than --features 20"),
    ("logistic_regression", ["--l1", "-1"], "--l1: '-1' is not a finite number >= 0"),
    ("logistic_regression", ["--separation", "nan"], "--separation: 'nan'"),
    ("linear_regression", ["--max-seconds", "5"], "--max-seconds limits the DataLoader's epochs, which only "
     "--compare runs"),
    ("word2vec", ["--vocab", "0"], "--vocab: '0' is not a positive integer"),
    ("word2vec", ["--steps", "0"], "--steps: '0' is not a positive integer"),
    ("word2vec", ["--epochs", "2", "--steps", "3"], "as --epochs or as --steps, not both"),
    ("word2vec", ["--wordsim", "{tmp}/missing.tsv"], "--wordsim: no file at"),
    ("word2vec", ["--analogies", "{tmp}/missing.txt"], "--analogies: no file at"),
    ("word2vec", ["--save", "{tmp}/missing/vectors.txt"], "--save: no directory"),
    ("word2vec", ["--save", "{tmp}"], "--save: '.*' is a directory"),
    ("word2vec", ["--binary"], "--binary is the format of --save"),
    # Options of the other corpus were ignored without a word.
    ("word2vec", ["--corpus", str(EXAMPLES / "word2vec.py"), "--topics", "3"], "--topics shapes the synthetic "
     "corpus, which --corpus replaces"),
    ("word2vec", ["--corpus", str(EXAMPLES / "word2vec.py"), "--tokens", "9", "--topics", "3"],
     "--topics and --tokens shape"),
    ("word2vec", ["--min-count", "2"], "--min-count filters the words of a --corpus"),
    # What the sharded run would ignore is refused by name.
    *[("word2vec", ["--distributed", *option], f"--distributed does not take {named}")
      for option, named in ((["--speedtorch-api"], "--speedtorch-api"), (["--epochs", "2"], "--epochs"),
                            (["--schedule", "linear"], "--schedule linear"), (["--cache-rows", "5"], "--cache-rows"),
                            (["--closed-form"], "--closed-form"))],
    # Without torchrun's variables the process group would wait for ever.
    *[(name, ["--distributed"], "launch it with torchrun") for name in ("word2vec", "recommender")],
]


@pytest.mark.parametrize("name, args, message", BAD_ARGUMENTS,
                         ids=[" ".join([name, *args]) for name, args, _ in BAD_ARGUMENTS])
def test_examples_refuse_bad_arguments_before_they_start(name, args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    error = _refused(name, [arg.format(tmp=tmp_path) for arg in args], capsys)
    assert re.search(message, error), error
    assert sorted(tmp_path.iterdir()) == []  # no data directory, no figures


@pytest.mark.parametrize("occupant, message", [
    ("a file", "--table-dir: '.*' is a file; give a directory for the table files"),
    ("a directory holding files", "--table-dir: '.*' is not empty; give a new or empty directory"),
])
def test_word2vec_refuses_a_table_dir_it_cannot_fill_before_it_builds_the_corpus(occupant, message, tmp_path,
                                                                                   capsys, monkeypatch):
    import speedswap.apps.corpus as corpus
    table_dir = tmp_path / "tables"
    if occupant == "a file":
        table_dir.write_text("someone's")
    else:
        (table_dir / "centre").mkdir(parents=True)
        (table_dir / "centre" / "table.npy").write_text("a run's")
    # A text8-sized corpus takes a minute to read: it was built, then train() refused the directory.
    monkeypatch.setattr(corpus, "synthetic_corpus", lambda *a, **k: pytest.fail("the corpus was built"))
    error = _refused("word2vec", ["--storage", "mmap", "--table-dir", table_dir], capsys)
    assert re.search(message, error), error


def test_logistic_regression_refuses_arrays_it_cannot_train_on(tmp_path, capsys, rng):
    x = rng.standard_normal((60, 3))
    np.save(tmp_path / "y.npy", rng.integers(0, 3, 60))
    np.save(tmp_path / "ybig.npy", np.r_[rng.integers(0, 3, 59), 2_000_000])  # 2,000,001 classes
    # One bad value at a random place: "x > 2" left none in 1.6% of draws (seed 1436091541).
    bad = np.zeros(x.shape, bool)
    bad[rng.integers(60), rng.integers(3)] = True
    for name, array in [("nan", np.where(bad, np.nan, x)), ("inf", np.where(bad, np.inf, x)),
                        ("str", np.array(["a"] * 60)), ("0d", np.float32(1.0))]:
        np.save(tmp_path / f"x{name}.npy", array)
    np.save(tmp_path / "xobj.npy", np.array([{}] * 60, dtype=object), allow_pickle=True)
    np.save(tmp_path / "x.npy", x)
    for x_name, y_name, message in [("xnan", "y", "row \\d+ holds NaN or infinite features"),
                                    ("xinf", "y", "NaN or infinite"), ("xstr", "y", "holds <U1 values, not numbers"),
                                    ("xobj", "y", "not a .npy array of numbers"), ("x0d", "y", "0-d array"),
                                    ("x", "ybig", "class id 2000000 for 60 rows")]:
        error = _refused("logistic_regression", ["--x", tmp_path / f"{x_name}.npy", "--y", tmp_path / f"{y_name}.npy"],
                         capsys)
        assert re.search(message, error), error


def test_logistic_regression_refuses_arrays_without_rows(tmp_path, capsys):
    """An empty --x is argparse's one-line error, not numpy's reshape traceback."""
    np.save(tmp_path / "y.npy", np.zeros(0, np.int64))
    for name, array in [("x2d", np.zeros((0, 3), np.float32)), ("x1d", np.zeros(0, np.float32))]:
        np.save(tmp_path / f"{name}.npy", array)
        error = _refused("logistic_regression", ["--x", tmp_path / f"{name}.npy", "--y", tmp_path / "y.npy"],
                         capsys)
        assert re.search(r"--x .* holds no rows", error), error


def test_recommender_refuses_malformed_ratings(tmp_path, capsys):
    recommender = load_example("recommender")
    files = {"empty.data": "", "junk.csv": "a,b,c\nx,y,z\n", "spaces.data": "1 1 5 0\n2 1 3 0\n",
             "nan.csv": "userId,movieId,rating,timestamp\n1,1,5,0\n2,1,nan,0\n",
             "binary.data": "\x00\udcff\x01"}
    for name, text in files.items():
        (tmp_path / name).write_text(text, errors="surrogateescape")
        with pytest.raises(ss.FileFormatError, match="MovieLens"):
            recommender.read_ratings(tmp_path / name)
    # One rating leaves nothing to test on: refused before any table is built.
    (tmp_path / "one.data").write_text("1\t1\t5\t0\n")
    assert "leaves 0 to train on and 1 to test" in _refused("recommender", ["--ratings", tmp_path / "one.data"],
                                                             capsys)


def test_recommender_table_difference_cannot_hide_a_nan():
    recommender = load_example("recommender")
    ours = [np.zeros((3, 2), np.float32), np.zeros((4, 2), np.float32)]
    theirs = [table + 1e-7 for table in ours]
    assert recommender.largest_difference(ours, theirs) == pytest.approx(1e-7)
    theirs[1][0, 0] = np.nan                   # a divergence in the second table, which max() dropped
    assert recommender.largest_difference(ours, theirs) == float("inf")
    ours[0][2, 1] = np.inf
    assert recommender.largest_difference(ours, [table.copy() for table in ours]) == float("inf")


def test_linear_regression_data_files_are_its_own_or_refused(tmp_path):
    lr = load_example("linear_regression")
    data = tmp_path / "data"
    x_path, y_path, w, b = lr.generate_dataset(data, rows=50, features=3, seed=1)
    made = {p.name: p.stat().st_mtime_ns for p in data.iterdir()}
    assert sorted(made) == ["X.npy", "Y.npy", "truth.npz"]
    again = lr.generate_dataset(data, rows=50, features=3, seed=1)  # the same dataset: reused
    assert {p.name: p.stat().st_mtime_ns for p in data.iterdir()} == made and again[3] == b
    lr.generate_dataset(data, rows=60, features=3, seed=1)          # its own, another size: replaced
    assert np.load(x_path).shape == (60, 3)
    truth = dict(np.load(data / "truth.npz"))                      # a run stopped half-way: replaced
    np.savez(data / "truth.npz", **{**truth, "complete": False})
    lr.generate_dataset(data, rows=60, features=3, seed=1)
    assert bool(np.load(data / "truth.npz")["complete"])
    (data / "truth.npz").unlink()                                   # now they are nobody's: refused
    with pytest.raises(ss.PathError, match="did not make"):
        lr.generate_dataset(data, rows=60, features=3, seed=1)
    assert sorted(p.name for p in data.iterdir()) == ["X.npy", "Y.npy"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ss.PathError, match="is a file"):
        lr.generate_dataset(tmp_path / "file", rows=50, features=3)
    with pytest.raises(ss.OptionError):
        lr.generate_dataset(tmp_path / "none", rows=0, features=3)
    assert not (tmp_path / "none").exists()


def test_linear_regression_time_limit_still_sees_a_batch(rng):
    lr = load_example("linear_regression")
    x, y = rng.random((200, 3), dtype=np.float32), rng.random(200, dtype=np.float32)
    feeder = ss.BatchFeeder(x, y, batch_size=50, device="cpu")
    mean, std = torch.from_numpy(x.mean(0)), torch.from_numpy(x.std(0))
    (epoch,) = lr.fit(feeder, mean, std, np.ones(3, np.float32), epochs=1, lr=0.05, device="cpu",
                      label="limited", progress=False, max_seconds=1e-9)  # was a ZeroDivisionError
    assert not epoch["complete"] and np.isfinite(epoch["seconds"]) and np.isfinite(epoch["loss"])


def test_word2vec_refuses_a_binary_corpus(tmp_path):
    (tmp_path / "corpus.bin").write_bytes(bytes(range(256)) * 4)
    code, err = _fails([EXAMPLES / "word2vec.py", "--device", "cpu", "--corpus", tmp_path / "corpus.bin"])
    # Line 2 starts at byte 11 (after the first newline); byte 128 is its first that is not ASCII.
    assert code == 2 and "--corpus" in err and "line 2, byte 128: not UTF-8" in err and "Traceback" not in err, err


def test_notebooks_remove_their_temporary_folders():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        code = "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"]
                         if cell["cell_type"] == "code")
        for folder in re.findall(r"(\w+) = tempfile\.mkdtemp\(", code):
            assert f"shutil.rmtree({folder})" in code, f"{path.name} leaves its {folder} behind"


def test_word2vec_on_a_corpus_of_fewer_words_than_neighbours_lists_them_and_saves(tmp_path):
    (tmp_path / "corpus.txt").write_text("a b c d e a b c\nb c d a\n")  # 5 words, 8 neighbours asked
    # --subsample 0: every word here is frequent, and whether subsampling kept two of a document's was the
    # seed's stream's luck (the epochs' streams changed, and it kept none: "no skip-gram pairs in a pass").
    out, _ = run_example("word2vec", ["--corpus", tmp_path / "corpus.txt", "--min-count", "1", "--subsample", "0",
                                      "--save", tmp_path / "vectors.txt"], tmp_path)  # was topk's RuntimeError
    listed = [line.split(": ") for line in out.splitlines()[out.splitlines().index("nearest neighbours:") + 1:]]
    assert listed and all(len(row.split(", ")) == 4 and word.strip() not in row.split(", ") for word, row in listed)
    assert (tmp_path / "vectors.txt").read_text().startswith("5 64\n")


def test_word2vec_saving_a_npy_past_the_file_size_limit_leaves_the_old_file(tmp_path):
    import resource
    old = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "vectors.npy", old)
    args = [EXAMPLES / "word2vec.py", "--device", "cpu", "--quiet", "--vocab", "2000", "--topics", "20", "--tokens",
            "20000", "--dim", "64", "--steps", "2", "--batch-size", "256", "--save", tmp_path / "vectors.npy"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    limit = 100 * 1024  # the 2000 x 64 float32 vectors take 512 KB; Python ignores SIGXFSZ, so a write fails
    done = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert done.returncode == 1 and "could not save" in done.stderr and "Traceback" not in done.stderr, done.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "vectors.npy"), old)  # was truncated to the limit
    assert sorted(os.listdir(tmp_path)) == ["vectors.npy"]


def test_the_json_figures_are_replaced_whole_or_not_at_all(tmp_path):
    """--json was written in place: a failure mid-write left half a file where the last run's figures were."""
    common = load_example("_common")
    path = tmp_path / "figures.json"
    common.write_json(argparse.Namespace(json=str(path)), {"loss": 0.25})
    with pytest.raises(TypeError):  # not JSON: the dump stops part way
        common.write_json(argparse.Namespace(json=str(path)), {"loss": 0.5, "model": object()})
    assert json.loads(path.read_text()) == {"loss": 0.25}
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]
