"""``SUMMARY.md`` of a ``bench --all`` run: the machine, each step, each figure and each target.

Every figure comes from the run's record; a target whose step did not run is
listed as skipped with the reason, never left out.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from . import feeder, training_step, transport, word2vec

__all__ = ["render_summary", "markdown_table", "target_rows"]

_TARGET_LABELS = {
    "gather_fraction_of_h2d": "gather / pinned H2D copy bandwidth",
    "scatter_fraction_of_d2h": "scatter / pinned D2H copy bandwidth",
    "round_trip_vs_speedtorch": "gather+scatter speed-up over SpeedTorch (CuPy on pinned memory)",
    "round_trip_vs_torch_pinned": "gather+scatter speed-up over pinned torch + .cuda() + index_put_",
}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; floats to 3 significant digits, None as a dash.

    A cell's line breaks (a multi-line error message) become ``<br>``: a newline would end the row.
    """
    def cell(value):
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.3g}"
        return str(value).replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _goal(target: tuple) -> str:
    op, value = target
    return f"{'≥' if op == '>=' else '≤'} {value:g}"


def _met(value: Optional[float], target: tuple) -> str:
    if value is None:
        return "—"
    op, goal = target
    return "yes" if (value >= goal if op == ">=" else value <= goal) else "**no**"


def _case_label(config: dict) -> str:
    label = f"{config['row_bytes']} B {config['dtype']} rows"
    return label + " (SpeedTorch case)" if config["row_bytes"] == 512 and config["dtype"] == "float32" else label


def _result(record: dict, step: str) -> Optional[dict]:
    outcome = record["steps"].get(step, {})
    return outcome.get("result") if outcome.get("status") == "ran" else None


def _why_not(record: dict, step: str, part: str) -> str:
    """Why ``part`` of ``step`` has no GPU figure in this run."""
    outcome = record["steps"].get(step, {"status": "failed", "reason": "not run"})
    if outcome["status"] == "failed":
        return f"skipped: the {step} step failed ({outcome['reason']})"
    return f"skipped: {outcome.get('reason') or part + ' did not run'}"


def target_rows(record: dict) -> list:
    """``[target, goal, measured, met]`` for every target of the GPU suite, measured or skipped."""
    rows = []
    gpu_cases = (_result(record, "transport") or {}).get("gpu")
    if gpu_cases:
        for case in gpu_cases:
            for key, target in transport.GPU_TARGETS.items():
                value = case["targets"][key]
                measured = value if value is not None else "skipped: " + "; ".join(case["config"]["skipped"].values())
                rows.append([f"{_case_label(case['config'])}: {_TARGET_LABELS[key]}", _goal(target), measured,
                             _met(value, target)])
    else:
        why = _why_not(record, "transport", "the GPU transport")
        rows += [[f"{_TARGET_LABELS[key]} (every row size)", _goal(target), why, "—"]
                 for key, target in transport.GPU_TARGETS.items()]
    training = _result(record, "training step")
    if training and training["setup"]["device"].startswith("cuda"):
        for entry in training["results"]:
            how = "interleaved" if entry["in_memory"]["interleaved"] else "one after the other"
            rows.append([f"training throughput offloaded / all-GPU, vocab {entry['vocab']:,} ({how})",
                         _goal(training_step.TARGET), entry["throughput_ratio"],
                         _met(entry["throughput_ratio"], training_step.TARGET)])
            if "one_lookup_throughput_ratio" in entry:  # runs before 2026-11-28's third had none
                rows.append([f"the same, each step's ids looked up in one call (both sides), vocab "
                             f"{entry['vocab']:,}", _goal(training_step.TARGET), entry["one_lookup_throughput_ratio"],
                             _met(entry["one_lookup_throughput_ratio"], training_step.TARGET)])
            rows.append([f"training throughput with cache and prefetch / all-GPU, vocab {entry['vocab']:,}",
                         _goal(training_step.CACHED_TARGET), entry["cached_throughput_ratio"],
                         _met(entry["cached_throughput_ratio"], training_step.CACHED_TARGET)])
            if "cached_no_prefetch_throughput_ratio" in entry:  # runs before 2026-11-30 had none
                rows.append([f"the same with the cache alone, no prefetch (what prefetch costs or gains), "
                             f"vocab {entry['vocab']:,}", "—", entry["cached_no_prefetch_throughput_ratio"], "—"])
            if "cached_one_lookup_throughput_ratio" in entry:  # runs before 2026-11-28's fourth had none
                rows.append([f"the same with the cache, each step's ids looked up in one call (both sides), "
                             f"vocab {entry['vocab']:,}", _goal(training_step.CACHED_TARGET),
                             entry["cached_one_lookup_throughput_ratio"],
                             _met(entry["cached_one_lookup_throughput_ratio"], training_step.CACHED_TARGET)])
            gap = entry["cached_gap_ratio"]
            rows.append([f"gap to all-GPU with the cache / without, vocab {entry['vocab']:,}",
                         _goal(training_step.GAP_TARGET),
                         gap if gap is not None else "no gap without the cache",
                         _met(gap, training_step.GAP_TARGET)])
            rows.append([f"GPU memory at vocab {entry['vocab']:,}: all-GPU / offloaded (MiB, resident)",
                         "offloaded flat in vocab",
                         f"{entry['in_memory']['device_bytes'] / 2**20:,.0f} / "
                         f"{entry['offloaded']['device_bytes'] / 2**20:,.0f}", "—"])
    else:
        why = _why_not(record, "training step", "the GPU training step")
        rows += [["training throughput offloaded / all-GPU", _goal(training_step.TARGET), why, "—"],
                 ["training throughput with cache and prefetch / all-GPU",
                  _goal(training_step.CACHED_TARGET), why, "—"],
                 ["gap to all-GPU with the cache / without", _goal(training_step.GAP_TARGET), why, "—"],
                 ["GPU memory at vocab 1M and 10M", "offloaded flat in vocab", why, "—"]]
    beyond = (_result(record, "beyond gpu") or {}).get("beyond_gpu")
    if beyond and "skipped" not in beyond:
        rows.append(_beyond_gpu_row(beyond))
    elif beyond and not record["steps"]["beyond gpu"].get("reason"):  # a GPU run that could not hold it
        rows.append([_BEYOND_GPU_LABEL, "trains", f"skipped: {beyond['skipped']}", "—"])
    else:
        rows.append([_BEYOND_GPU_LABEL, "trains",
                     _why_not(record, "beyond gpu", "the vocabulary beyond the GPU's memory"), "—"])
    regression = (_result(record, "feeder") or {}).get("regression")
    label = "feeder epoch (FFCV regression shape) / pinned copy of the same bytes"
    if regression and regression["device"].startswith("cuda"):
        rows.append([label, _goal(feeder.TARGET), regression["feeder_over_limit"],
                     _met(regression["feeder_over_limit"], feeder.TARGET)])
    else:
        rows.append([label, _goal(feeder.TARGET), _why_not(record, "feeder", "the GPU feeder case"), "—"])
    return rows + _word2vec_targets(record)


_BEYOND_GPU_LABEL = "a vocabulary whose table + Adam state exceed the GPU's memory trains"


def _beyond_gpu_row(entry: dict) -> list:
    """The target row of the vocabulary beyond the GPU's memory, which trained."""
    trained = "yes" if entry["loss_after"] < entry["loss_before"] else "**no**"
    return [_BEYOND_GPU_LABEL, "trains", training_step.describe_beyond_gpu(entry), trained]


def _word2vec_targets(record: dict) -> list:
    """The word2vec job's two targets: the GPU against this machine's CPU, and against gensim."""
    job = _result(record, "word2vec")
    cpu_label = "word2vec demo words/s: GPU (demo recipe) / the same job on this machine's CPU"
    gensim_label = "word2vec words/s: fastest GPU contender / gensim on this machine's cores"
    if not job or not job["ratios"]:
        failed = [name for name in (job or {}).get("failures", {}) if name.startswith("gpu")]
        # A GPU run whose every GPU contender raised: say so, not that the job did not run.
        why = ("skipped: every GPU contender failed (" + "; ".join(f"{name} {job['skipped'][name]}"
                                                                   for name in failed) + ")"
               if failed else _why_not(record, "word2vec", "the GPU word2vec job"))
        return [[cpu_label, _goal(word2vec.CPU_TARGET), why, "—"],
                [gensim_label, _goal(word2vec.GENSIM_TARGET), why, "—"]]
    if "gpu" in job["ratios"]:
        over_cpu = job["ratios"]["gpu"]["over_cpu"]
        rows = [[cpu_label, _goal(word2vec.CPU_TARGET), over_cpu, _met(over_cpu, word2vec.CPU_TARGET)]]
    else:  # the demo recipe's contender failed; the others still count against gensim
        rows = [[cpu_label, _goal(word2vec.CPU_TARGET), "skipped: gpu " + job["skipped"]["gpu"], "—"]]
    if "gensim" in job["skipped"]:
        return rows + [[gensim_label, _goal(word2vec.GENSIM_TARGET), "skipped: " + job["skipped"]["gensim"], "—"]]
    name, ratios = max(job["ratios"].items(), key=lambda item: item[1]["over_gensim"])
    return rows + [[f"{gensim_label} ({name})", _goal(word2vec.GENSIM_TARGET), ratios["over_gensim"],
                    _met(ratios["over_gensim"], word2vec.GENSIM_TARGET)]]


def _machine_section(record: dict) -> str:
    m = record["machine"]
    gib = lambda n: None if n is None else f"{n / 2**30:.1f} GiB"  # noqa: E731
    rows = [["date (UTC)", m["date"]], ["host", m["host"]], ["CPU", f"{m['cpu']}, {m['cores']} cores"],
            ["RAM", f"{gib(m['ram_bytes'])} ({gib(m['ram_available_bytes'])} free at the start)"],
            ["load average (1, 5, 15 min)", f"{m['load_average']} at the start, "
                                            f"{record.get('load_average_after')} "
                                            f"{'at the end' if record['finished'] else 'when this was written'}"],
            ["GPU", m["gpu"] or "none visible"],
            ["GPU memory", gib(m.get("gpu_memory_bytes"))], ["driver", m.get("driver")],
            ["CUDA (torch build)", m.get("cuda")], ["PCIe link (gen, width)", m.get("pcie_link")],
            ["torch", m["torch"]], ["CuPy", m.get("cupy")], ["cuda backend", m.get("cuda_backend")],
            ["numpy", m["numpy"]],
            ["Python", m["python"]], ["speedswap", m["speedswap"]]]
    return "## Machine\n\n" + markdown_table(["", ""], rows)


def _steps_section(record: dict) -> str:
    rows = [[name, outcome["status"], outcome["seconds"], outcome.get("json"), outcome.get("reason")]
            for name, outcome in record["steps"].items()]
    over = record["seconds"] > record["budget_s"]
    total = "Total" if record["finished"] else "Not finished: so far"
    return ("## Steps\n\n" + markdown_table(["step", "status", "seconds", "figures in", "note"], rows)
            + f"\n\n{total} {record['seconds']:.0f} s"
            + (f", over the {record['budget_s']} s budget." if over else f" (budget {record['budget_s']} s)."))


def _gpu_tests_section(record: dict) -> str:
    outcome = record["steps"].get("gpu tests", {})
    if "tests" not in outcome:
        return f"## GPU tests\n\n{outcome.get('status', 'not run')}: {outcome.get('reason')}"
    lines = [f"`{outcome['command']}`: {outcome['tests']} selected, {outcome['passed']} passed, "
             f"{outcome['failed']} failed, {outcome['errors']} errors, {outcome['skipped']} skipped "
             f"in {outcome['seconds']:.1f} s (log: `{outcome['log']}`)."]
    if outcome.get("reason"):
        lines.append(outcome["reason"] + ".")
    lines += [f"- failed: `{name}`" for name in outcome["failed_tests"]]
    lines += [f"- skip reason: {reason}" for reason in outcome["skip_reasons"]]
    return "## GPU tests\n\n" + "\n".join(lines)


def _step_section(record: dict, step: str, title: str, body: Callable[[dict], str]) -> str:
    """The section ``## title`` of a suite step: ``body(result)``, or why the step was not measured."""
    outcome = record["steps"].get(step)
    if outcome is None or outcome["status"] != "ran":
        return f"## {title}\n\nnot measured: {(outcome or {}).get('reason', 'not run')}"
    return f"## {title}\n\n{body(_result(record, step))}"


def _transport_body(result: dict) -> str:
    parts = []
    if "cpu" in result:
        cpu = result["cpu"]
        config = cpu["config"]
        parts.append(f"CPU, {config['num_ids']:,} of {config['num_rows']:,} x {config['dim']} float32 rows "
                     f"(median of {config['repeats']}, interleaved):")
        # Each table's reference is torch's own call of the same operation.
        for direction, reference in (("gather", "index_select"), ("scatter", "index_copy_")):
            parts.append(f"{direction.capitalize()}:")
            parts.append(markdown_table(["method", "median ms", "GB/s", f"speed-up over torch {reference}"],
                                        [[r["method"], r["median_ms"], r["GB/s"], r["vs_ref"]] for r in cpu[direction]]))
        parts.append(markdown_table(["CPU ratio", "value"], [[k, v] for k, v in cpu["targets"].items()]))
    if result.get("gpu_skipped"):
        parts.append(f"GPU cases {result['gpu_skipped']}.")
    for case in result.get("gpu", []):
        config = case["config"]
        speeds = {row["method"].split(" ")[0]: row["GB/s"] for row in case["to_gpu"]}
        back = {row["method"].split(" ")[0]: row["GB/s"] for row in case["from_gpu"]}
        contiguous = next((row["method"][4:] for row in case["to_gpu"] if row["method"].startswith("(g)")), None)
        parts.append(f"GPU, {_case_label(config)}: {config['num_ids']:,} ids of {config['num_rows']:,} rows "
                     f"(median of {config['repeats']}, interleaved, CUDA events). Ceilings in the same run: "
                     f"pinned H2D {speeds['(d)']:.1f} GB/s, pinned D2H {back['(d)']:.1f} GB/s, "
                     f"device-to-device {speeds['(e)']:.1f} GB/s"
                     + (f", the same bytes as {contiguous} {speeds['(g)']:.1f} GB/s read, "
                        f"{back['(g)']:.1f} GB/s written" if contiguous else "") + ".")
        from_rows = {row["method"].split(" ")[0]: row for row in case["from_gpu"]}
        rows = []
        for row in case["to_gpu"]:
            other = from_rows.get(row["method"].split(" ")[0])
            rows.append([row["method"], row["median_ms"], row["GB/s"],
                         other and other["method"], other and other["median_ms"], other and other["GB/s"]])
        parts.append(markdown_table(["to GPU", "median ms", "GB/s", "from GPU", "median ms", "GB/s"], rows))
    return "\n\n".join(parts)


def _training_body(result: dict) -> str:
    setup = result["setup"]
    mib = lambda n: None if n is None else n / 2**20  # noqa: E731
    rows = [[f"{e['vocab']:,}", e["in_memory"]["median_s"] * 1e3, e["offloaded"]["median_s"] * 1e3,
             e["cached"]["median_s"] * 1e3, e["throughput_ratio"], e["cached_throughput_ratio"],
             e["cached_no_prefetch"]["median_s"] * 1e3 if "cached_no_prefetch" in e else "—",
             e.get("cached_no_prefetch_throughput_ratio", "—"),
             "yes" if e["in_memory"]["interleaved"] else "no",
             mib(e["in_memory"]["device_bytes"]), mib(e["in_memory"]["device_peak_bytes"]),
             mib(e["offloaded"]["device_bytes"]), mib(e["offloaded"]["device_peak_bytes"])]
            for e in result["results"]]
    table = markdown_table(["vocab", "in-memory ms", "offloaded ms", "cached ms",
                            "throughput offloaded / in-memory", "throughput cached / in-memory",
                            "cached, no prefetch ms", "throughput cached, no prefetch / in-memory", "interleaved", "in-memory MiB", "in-memory peak MiB", "offloaded MiB",
                            "offloaded peak MiB"], rows)
    one_lookup = [[f"{e['vocab']:,}", e["in_memory_one_lookup"]["median_s"] * 1e3,
                   e["offloaded_one_lookup"]["median_s"] * 1e3, e["one_lookup_throughput_ratio"]]
                  + ([e["cached_one_lookup"]["median_s"] * 1e3, e["cached_one_lookup_throughput_ratio"]]
                     if "cached_one_lookup" in e else ["—", "—"])
                  for e in result["results"] if "one_lookup_throughput_ratio" in e]
    if one_lookup:
        table += (f"\n\nOne lookup a step: {setup['one_lookup']}.\n\n"
                  + markdown_table(["vocab", "in-memory ms", "offloaded ms", "throughput offloaded / in-memory",
                                    "cached ms", "throughput cached / in-memory"], one_lookup))
    return (f"Skip-gram, Adam, {setup['batch']} pairs x {setup['negatives']} negatives, "
            f"dim {setup['dim']}, Zipf ids, on {setup['device']}; in memory: {setup['in_memory']}; "
            f"offloaded: {setup['offloaded']}; cached: {setup['cached']}. "
            f"Device memory: {setup['device_memory']}.\n\n" + table)


def _beyond_gpu_body(result: dict) -> str:
    return ("The offloaded setup of the training step alone, at a vocabulary whose table and Adam "
            "state exceed the GPU's memory: " + training_step.describe_beyond_gpu(result["beyond_gpu"]) + ".")


def _feeder_body(result: dict) -> str:
    result = result["regression"]
    (rows, dim), batch = result["shape"], result["batch"]
    return (f"FFCV linear-regression shape on {result['device']}: {rows:,} x {dim} float32 + "
            f"targets, batch {batch}, random order; limit: {result['limit']} of the same bytes. "
            f"BatchFeeder takes {result['feeder_over_limit']:.3g}x the limit's time.\n\n"
            + markdown_table(["case", "epoch s (median)", "min s", "max s", "x limit"],
                             [[r["case"], r["epoch_s"], r["min_s"], r["max_s"], r["vs_limit"]]
                              for r in result["rows"]]))


def _word2vec_body(result: dict) -> str:
    setup = result["setup"]
    rows = [[c["name"], f"{c['words_per_second']:,.0f}", c["topic_purity"],
             result["ratios"].get(c["name"], {}).get("over_cpu"),
             result["ratios"].get(c["name"], {}).get("over_gensim"), len(c["runs"])]
            for c in result["contenders"]]
    skipped = "\n".join(f"- {name} skipped: {why}" for name, why in result["skipped"].items())
    return (f"The demo's job (`python -m speedswap demo`): synthetic corpus, vocabulary "
            f"{setup['vocab']:,}, {setup['tokens']:,} tokens, dim {setup['dim']}, {setup['epochs']} epoch(s), "
            f"batch {setup['batch_size']}, window {setup['window']}, {setup['negatives']} negatives; "
            f"{setup['cores']} cores; median of {setup['rounds']} run(s) per contender, in rotating order. "
            f"Topic purity by chance: {setup['chance']:.3f}.\n\n"
            + markdown_table(["contender", "words/s", "topic purity", "x cpu", "x gensim", "runs"], rows)
            + (f"\n\n{skipped}" if skipped else ""))


def render_summary(record: dict) -> str:
    """The Markdown summary of :func:`~speedswap.apps.bench.suite.run_all`'s record.

    Args:
        record: what ``run_all`` returns.

    Returns:
        Markdown text with the sections Machine, Steps, Targets, GPU tests,
        Transport, Training step, Feeder, word2vec and Beyond the GPU's memory.
    """
    mode = ("dry run: tiny sizes on the CPU, GPU parts skipped" if record["mode"] == "dry run"
            else "full GPU suite")
    targets = markdown_table(["target", "goal", "measured", "met"], target_rows(record))
    return "\n\n".join([
        f"# speedswap bench --all ({mode})",
        "Every figure below was measured in this run; ratios compare contenders timed side by side "
        "(interleaved rounds, medians). The JSON files beside this summary hold every repeat's spread.",
        _machine_section(record), _steps_section(record), "## Targets\n\n" + targets,
        _gpu_tests_section(record), _step_section(record, "transport", "Transport", _transport_body),
        _step_section(record, "training step", "Training step", _training_body),
        _step_section(record, "feeder", "Feeder", _feeder_body),
        _step_section(record, "word2vec", "word2vec", _word2vec_body),
        _step_section(record, "beyond gpu", "Beyond the GPU's memory", _beyond_gpu_body)]) + "\n"
