"""benchmarks/compare.py: a fresh result's ratios against a baseline's, paired by where they sit."""

import collections
import importlib.util
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compare.py"
spec = importlib.util.spec_from_file_location("bench_compare", SCRIPT)
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def _training(ratios, load=0.3):
    """A training_step-shaped result with one row per vocabulary."""
    return {"benchmark": "training_step", "machine": {"cores": 2, "load_average": [load, 0.2, 0.1]},
            "results": [{"vocab": vocab, "ratio": ratio, "throughput_ratio": 1 / ratio,
                         "offloaded": {"median_s": random.uniform(0.01, 0.1)}}
                        for vocab, ratio in ratios.items()]}


def _write(path, result):
    path.write_text(json.dumps(result))
    return str(path)


def test_a_ratio_that_got_worse_beyond_the_tolerance_fails_and_one_within_it_does_not(tmp_path, capsys):
    rng = random.Random(7)
    small, large = rng.uniform(0.4, 0.6), rng.uniform(0.6, 0.8)
    base = _write(tmp_path / "a.json", _training({1_000_000: small, 10_000_000: large}))
    new = _write(tmp_path / "b.json", _training({1_000_000: small * 1.05, 10_000_000: large * 1.5}))
    assert compare.main([base, new, "--tolerance", "0.1"]) == 1
    out = capsys.readouterr().out
    verdicts = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.startswith("results/")}
    assert verdicts == {"results/[vocab=1000000]/ratio": "same",
                        "results/[vocab=1000000]/throughput_ratio": "same",
                        "results/[vocab=10000000]/ratio": "worse",
                        "results/[vocab=10000000]/throughput_ratio": "worse"}
    # A wider tolerance takes the same change as noise.
    assert compare.main([base, new, "--tolerance", "0.6"]) == 0


def test_rows_are_paired_by_what_they_measure_not_by_their_position(tmp_path):
    rng = random.Random(11)
    figures = {vocab: rng.uniform(0.3, 0.9) for vocab in (10 ** 5, 10 ** 6, 10 ** 7)}
    base = _training(figures)
    new = _training(figures)
    new["results"].reverse()
    new["results"][0]["ratio"] *= 0.5  # vocabulary 10**7 got twice as fast
    rows = {path: verdict for path, _, _, _, verdict in compare.compare(base, new, 0.1)}
    assert rows["results/[vocab=10000000]/ratio"] == "better"
    assert rows["results/[vocab=100000]/ratio"] == rows["results/[vocab=1000000]/ratio"] == "same"


def test_the_good_direction_of_each_ratio_decides_better_or_worse():
    base = {"benchmark": "feeder", "fast_loops": {"ratios": {
        "speedup_vs_per_item": 36.5, "feeder_over_numpy": 0.71, "targets": {"feeder_over_numpy": "<= 1.25"}}}}
    new = {"benchmark": "feeder", "fast_loops": {"ratios": {
        "speedup_vs_per_item": 45.0, "feeder_over_numpy": 1.05, "targets": {"feeder_over_numpy": "<= 1.25"}}}}
    rows = {path.rsplit("/", 1)[1]: verdict for path, _, _, _, verdict in compare.compare(base, new, 0.1)}
    # Higher is better for a speed-up, lower for a time over a reference's; goals are not ratios.
    assert rows == {"speedup_vs_per_item": "better", "feeder_over_numpy": "worse"}


def test_the_gpu_word2vec_jobs_ratios_are_compared():
    rng = random.Random(5)
    over_cpu = {name: rng.uniform(0.4, 1.8) for name in ("gpu", "gpu closed form", "gpu batch x4")}

    def word2vec(scale):
        # As speedswap.apps.bench.word2vec.run writes it: one entry per GPU contender, goals in targets.
        return {"benchmark": "word2vec", "ratios": {name: {"over_cpu": ratio * scale.get(name, 1.0), "over_gensim": None}
                                                    for name, ratio in over_cpu.items()},
                "targets": {"gpu_over_cpu": [">=", 1.0], "gpu_over_gensim": [">=", 10.0]}}

    rows = {path: verdict for path, _, _, _, verdict in
            compare.compare(word2vec({}), word2vec({"gpu batch x4": 0.5}), 0.1)}
    assert rows == {"ratios/gpu/over_cpu": "same", "ratios/gpu closed form/over_cpu": "same",
                    "ratios/gpu batch x4/over_cpu": "worse"}


def test_a_ratio_of_zero_in_both_runs_is_the_same():
    rng = random.Random(3)
    hit = rng.uniform(0.3, 0.7)

    def cache(hit_rate):
        # The no-cache row of each distribution has a hit rate of 0 in every run.
        return {"benchmark": "cache", "rows": [
            {"distribution": "zipf 1.1", "cache_fraction": 0.0, "hit_rate": 0.0, "bytes_vs_no_cache": 1.0},
            {"distribution": "zipf 1.1", "cache_fraction": 0.05, "hit_rate": hit_rate, "bytes_vs_no_cache": 1 - hit_rate}]}

    verdicts = [verdict for _, _, _, _, verdict in compare.compare(cache(hit), cache(hit), 0.1)]
    assert verdicts == ["same"] * 4
    # From none to some is a change without a finite ratio, in the direction the ratio's name gives.
    rows = {path: verdict for path, _, _, _, verdict in compare.compare(cache(0.0), cache(hit), 0.1)}
    assert rows["rows/[distribution=zipf 1.1,cache_fraction=0.05]/hit_rate"] == "better"
    rows = {path: verdict for path, _, _, _, verdict in compare.compare(cache(hit), cache(0.0), 0.1)}
    assert rows["rows/[distribution=zipf 1.1,cache_fraction=0.05]/hit_rate"] == "worse"


def test_results_of_different_benchmarks_or_without_shared_ratios_are_refused(tmp_path, capsys):
    train = _write(tmp_path / "t.json", _training({1_000_000: 0.5}))
    feeder = _write(tmp_path / "f.json", {"benchmark": "feeder", "fast_loops": {"ratios": {"feeder_over_numpy": 0.8}}})
    other_vocab = _write(tmp_path / "v.json", _training({5: 0.5}))
    not_json = tmp_path / "n.json"
    not_json.write_text("{")
    assert compare.main([train, feeder]) == 2
    assert "'training_step' and 'feeder'" in capsys.readouterr().err
    assert compare.main([train, other_vocab]) == 2
    assert "share no ratio" in capsys.readouterr().err
    assert compare.main([train, str(not_json)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_a_run_under_load_is_flagged_as_noise(tmp_path, capsys):
    base = _write(tmp_path / "a.json", _training({1_000_000: 0.5}, load=0.4))
    new = _write(tmp_path / "b.json", _training({1_000_000: 0.5}, load=2.7))
    assert compare.main([base, new]) == 0
    out = capsys.readouterr().out
    assert "the new run saw a load average of 2.70" in out and "the baseline run" not in out
    unknown = _training({1_000_000: 0.5})
    del unknown["machine"]["load_average"]
    assert compare.main([base, _write(tmp_path / "c.json", unknown)]) == 0
    assert "the new run recorded no load average" in capsys.readouterr().out


def test_a_part_of_a_sweep_is_compared_with_the_whole_sweep():
    """cache.py --caches 0.05 writes a "cache-subset" result: it was refused beside the whole "cache" one."""
    row = {"distribution": "zipf 1.1", "cache_fraction": 0.05}
    whole = {"benchmark": "cache", "rows": [{**row, "bytes_vs_no_cache": 0.39},
                                            {**row, "cache_fraction": 0.2, "bytes_vs_no_cache": 0.24}]}
    part = {"benchmark": "cache-subset", "rows": [{**row, "bytes_vs_no_cache": 0.5}]}
    [(path, _, _, _, verdict)] = compare.compare(whole, part, 0.1)
    assert "cache_fraction=0.05" in path and verdict == "worse"
    with pytest.raises(compare.CompareError, match="'cache' and 'cache-prefetch'"):
        compare.compare(whole, {**part, "benchmark": "cache-prefetch"}, 0.1)


def test_a_load_average_triple_counts_its_one_minute_value_only():
    """working_set.py records load_average_before and _after triples: their 15-minute value (1.31, on a
    run at 0.42) flagged the run as noise."""
    result = {"benchmark": "working_set", "machine": {"cores": 2},
              "load_average_before": [0.42, 0.88, 1.31], "load_average_after": [0.47, 0.9, 1.3],
              "rows": [{"case": "skip-gram 64", "now / before": 0.9}]}
    assert compare.load_averages(result) == [0.42, 0.47]
    assert compare._noise(result) is None


@pytest.mark.parametrize("benchmark, row, name", [
    ("allocator", {"setup": "offloaded", "allocator": "tcmalloc"}, "vs_glibc"),
    ("working_set", {"case": "skip-gram 4096"}, "now / before"),
])
def test_the_allocator_and_working_set_ratios_are_compared(benchmark, row, name):
    rng = random.Random(5)
    value = rng.uniform(0.5, 0.9)
    base = {"benchmark": benchmark, "rows": [{**row, name: value}]}
    new = {"benchmark": benchmark, "rows": [{**row, name: value * 1.3}]}  # took 30% longer
    [(path, _, _, _, verdict)] = compare.compare(base, new, 0.1)
    assert name in path and verdict == "worse"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_one_file_is_compared_with_what_git_holds_of_it(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    result = repo / "results" / "training_step-cpu.json"
    _write(result, _training({1_000_000: 0.52}))

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                       check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "baseline")
    _write(result, _training({1_000_000: 0.91}))  # the fresh run wrote over the committed one
    assert compare.main([str(result)]) == 1
    assert "0.52 ->      0.91" in capsys.readouterr().out
    assert compare.main([str(result), "--rev", "HEAD~5"]) == 2
    assert "give the baseline file as well" in capsys.readouterr().err


def _eval_read(figures):
    """An eval_read-shaped result: per (distribution, cache share), the hit rate and the ratios to no cache."""
    return {"benchmark": "eval_read", "machine": {"cores": 2}, "loadavg_start": [0.3, 0.2, 0.1],
            "loadavg_end": [0.4, 0.2, 0.1],
            "rows": [{"distribution": distribution, "cache_fraction": fraction, "cache_rows": int(fraction * 1000),
                      "hit_rate": hit, "time_vs_no_cache": time, "rows_h2d_vs_no_cache": rows,
                      "bytes_h2d_vs_no_cache": rows, "time_difference_is_noise": False}
                     for (distribution, fraction), (hit, time, rows) in figures.items()]}


def test_the_eval_read_benchmarks_ratios_are_paired_by_distribution_and_cache_size():
    """eval_read.py's time, rows and bytes against no cache were left out: only its hit rates were compared."""
    rng = random.Random(13)
    figures = {(distribution, fraction): (rng.uniform(0.5, 0.9), rng.uniform(1.5, 4.0), rng.uniform(0.1, 0.3))
               if fraction else (0.0, 1.0, 1.0)
               for distribution in ("zipf 1.1", "uniform") for fraction in (0.0, 0.05, 0.2)}
    changed = dict(figures)
    hit, time, rows = figures["zipf 1.1", 0.05]
    changed["zipf 1.1", 0.05] = (hit, time * 1.5, rows)  # a cached forward got slower
    hit, time, rows = figures["uniform", 0.2]
    changed["uniform", 0.2] = (hit, time, rows * 0.5)  # and one read half the rows from the host
    new = _eval_read(changed)
    new["rows"].reverse()
    verdicts = {path: verdict for path, _, _, _, verdict in compare.compare(_eval_read(figures), new, 0.1)}
    assert len(verdicts) == 6 * 4, sorted(verdicts)
    assert verdicts.pop("rows/[distribution=zipf 1.1,cache_fraction=0.05]/time_vs_no_cache") == "worse"
    assert verdicts.pop("rows/[distribution=uniform,cache_fraction=0.2]/rows_h2d_vs_no_cache") == "better"
    assert verdicts.pop("rows/[distribution=uniform,cache_fraction=0.2]/bytes_h2d_vs_no_cache") == "better"
    assert set(verdicts.values()) == {"same"}
    # The committed result holds them all, for every row.
    committed = json.loads((SCRIPT.parent / "results" / "eval_read-cpu.json").read_text())
    names = collections.Counter(name for _, name, _ in compare.ratios(committed))
    assert names == dict.fromkeys(["hit_rate", "time_vs_no_cache", "rows_h2d_vs_no_cache", "bytes_h2d_vs_no_cache"],
                                  len(committed["rows"]))
