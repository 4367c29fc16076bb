"""Row transport: HostTable.gather/scatter against the obvious alternatives, side by side.

CPU: a float32 table and random ids. ``HostTable.gather`` vs
``torch.index_select`` and ``np.take`` on a torch/numpy table,
``HostTable.scatter`` vs ``index_copy_``, all relative to a contiguous copy of
the same bytes (the memory bandwidth ceiling). The torch kernels also run on
the HostTable's own memory, which separates speedswap's per-call overhead from
the effect of how its memory is allocated (transparent huge pages).

GPU: the SpeedTorch case, a 1,000,000 x 128 float32 pinned host table and
131,072 ids drawn with replacement, moved to a CUDA parameter and back.
speedswap vs (a) SpeedTorch's method: CuPy fancy indexing on a CuPy array in
pinned memory, (b) a pinned torch CPU tensor indexed on the CPU, then
``.cuda()`` / ``.cpu()`` + ``index_put_``, (c) an all-GPU table with
``index_select`` / ``index_copy_``, and the ceilings measured in the same
run: (d) a pinned contiguous copy of the same bytes in each direction (the
copy engine), (e) a device-to-device copy and (g) speedswap's zero-copy
kernel moving the same bytes as consecutive rows (a contiguous read and
write of mapped memory by a kernel: what random rows cost over it); (f) is speedswap without its
public call's id range check (one host wait inside the timed span, which the
targets' figures keep: they are what a user's call costs). Then rows of 64, 256 and 1024
bytes and bfloat16. Scatters reuse the gather's ids in every contender (as
SpeedTorch's benchmark did): they measure bytes moved, not which duplicate wins.

>>> result = run_cpu(num_rows=4096, dim=8, num_ids=512, repeats=2)
>>> sorted(result["targets"])[:2]
['gather_fraction_of_copy', 'gather_vs_index_select']
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

import speedswap as ss

from .timing import format_table, load_average, time_interleaved

__all__ = ["GPU_TARGETS", "GPU_CASES", "run_cpu", "run_gpu_case", "run_gpu", "format_cpu",
           "format_gpu", "cupy_missing"]

#: The GPU targets: ``name: (comparison, goal)``; each is a ratio, higher is better.
GPU_TARGETS = {
    "gather_fraction_of_h2d": (">=", 0.75),
    "scatter_fraction_of_d2h": (">=", 0.75),
    "round_trip_vs_speedtorch": (">=", 1.3),
    "round_trip_vs_torch_pinned": (">=", 20.0),
}

#: ``(dim, dtype)`` of each GPU case: the SpeedTorch case (512-byte rows),
#: float32 rows of 64, 256 and 1024 bytes, and bfloat16 rows of dim 128.
GPU_CASES = [(128, torch.float32), (16, torch.float32), (64, torch.float32), (256, torch.float32),
             (128, torch.bfloat16)]

_COLUMNS = ["method", "median_ms", "min_ms", "max_ms", "GB/s"]


def _row(name: str, summary: dict, nbytes: int, reference: Optional[dict] = None) -> dict:
    row = {"method": name, "median_ms": summary["median_s"] * 1e3,
           "min_ms": summary["min_s"] * 1e3, "max_ms": summary["max_s"] * 1e3,
           "GB/s": nbytes / summary["median_s"] / 1e9}
    if reference is not None:
        row["vs_ref"] = reference["median_s"] / summary["median_s"]
    return row


def run_cpu(num_rows: int = 2_000_000, dim: int = 128, num_ids: int = 131_072, repeats: int = 20,
            seed: int = 0) -> dict:
    """Measure CPU gather and scatter against torch, numpy and a contiguous copy.

    Args:
        num_rows: table rows (float32).
        dim: row length.
        num_ids: ids per gather (drawn with replacement) and per scatter (unique).
        repeats: timed rounds; contenders interleaved.
        seed: for the ids and the table's values.

    Returns:
        ``{"config", "gather", "scatter", "targets"}``: rows of figures per
        contender and the ratios (``*_vs_*``: speed-up over torch;
        ``*_fraction_of_copy``: share of the contiguous copy's speed).
    """
    rng = np.random.default_rng(seed)
    load = load_average()
    table = ss.HostTable.empty(num_rows, dim, storage="pageable", backend="numpy")
    table.uniform_(-1, 1, generator=torch.Generator().manual_seed(seed))
    same = torch.from_numpy(table.to_numpy())  # the table's own memory: the same kernel, no speedswap
    host = torch.empty(num_rows, dim).copy_(same)  # what a torch user would hold instead
    host_np = host.numpy()
    ids = torch.from_numpy(rng.integers(0, num_rows, size=num_ids))
    ids_np = ids.numpy()
    unique = torch.from_numpy(rng.choice(num_rows, size=num_ids, replace=False))
    out = torch.empty(num_ids, dim)
    out_np = out.numpy()
    values = torch.rand(num_ids, dim)
    block = host[:num_ids]
    nbytes = num_ids * dim * 4

    gather = time_interleaved({
        "HostTable.gather": lambda: table.gather(ids, out=out),
        "torch.index_select": lambda: torch.index_select(host, 0, ids, out=out),
        "index_select on the table's memory": lambda: torch.index_select(same, 0, ids, out=out),
        "np.take": lambda: np.take(host_np, ids_np, axis=0, out=out_np),
        "contiguous copy": lambda: out.copy_(block),
    }, repeats=repeats)
    scatter = time_interleaved({
        "HostTable.scatter": lambda: table.scatter(unique, values),
        "HostTable.scatter(check_unique=False)": lambda: table.scatter(unique, values, check_unique=False),
        "index_copy_": lambda: host.index_copy_(0, unique, values),
        "index_copy_ on the table's memory": lambda: same.index_copy_(0, unique, values),
        "contiguous copy": lambda: block.copy_(values),
    }, repeats=repeats)
    table.close()
    median = {("gather", k): v["median_s"] for k, v in gather.items()}
    median.update({("scatter", k): v["median_s"] for k, v in scatter.items()})
    return {
        "config": {"num_rows": num_rows, "dim": dim, "num_ids": num_ids, "dtype": "float32",
                   "repeats": repeats, "load_average_before": load},
        "gather": [_row(k, v, nbytes, gather["torch.index_select"]) for k, v in gather.items()],
        "scatter": [_row(k, v, nbytes, scatter["index_copy_"]) for k, v in scatter.items()],
        "targets": {
            "gather_vs_index_select":
                median["gather", "torch.index_select"] / median["gather", "HostTable.gather"],
            "scatter_vs_index_copy":
                median["scatter", "index_copy_"] / median["scatter", "HostTable.scatter"],
            "scatter_unchecked_vs_index_copy":
                median["scatter", "index_copy_"] / median["scatter", "HostTable.scatter(check_unique=False)"],
            "gather_fraction_of_copy":
                median["gather", "contiguous copy"] / median["gather", "HostTable.gather"],
            "scatter_fraction_of_copy":
                median["scatter", "contiguous copy"] / median["scatter", "HostTable.scatter"],
        },
    }


def cupy_missing() -> Optional[str]:
    """Why SpeedTorch's CuPy method cannot be measured here, or None when it can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'speedswap[cuda12]' or 'speedswap[cuda13]')"
    return None if cupy.is_available() else "CuPy sees no CUDA device"


#: CuPy has no bfloat16: SpeedTorch's baseline moves bfloat16 rows as int16 bit patterns.
_BITS = {torch.bfloat16: torch.int16}


def _speedtorch_table(cupy, values: torch.Tensor):
    """SpeedTorch's table: a CuPy array over pinned, mapped host memory.

    The memory is filled on the host through a numpy view of the pinned block
    (a CuPy ``.set()`` would issue a host-to-device copy whose destination is
    host memory, a copy of undefined direction). SpeedTorch's global
    allocator swap is not repeated.

    Returns:
        (cupy array, the PinnedMemory keeping it alive)
    """
    bits = _BITS.get(values.dtype, values.dtype)
    host_dtype = torch.empty(0, dtype=bits).numpy().dtype
    nbytes = values.numel() * values.element_size()
    memory = cupy.cuda.PinnedMemory(nbytes, 1 | 2)  # cudaHostAllocPortable | cudaHostAllocMapped
    host = np.ndarray(tuple(values.shape), dtype=host_dtype, buffer=cupy.cuda.PinnedMemoryPointer(memory, 0))
    torch.from_numpy(host).copy_(values.view(bits))
    device = torch.cuda.current_device()
    pointer = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(memory.ptr, nbytes, memory, device), 0)
    return cupy.ndarray(host.shape, dtype=host_dtype, memptr=pointer), memory


def run_gpu_case(num_rows: int, dim: int, num_ids: int, dtype: torch.dtype = torch.float32,
                 repeats: int = 20, seed: int = 0) -> dict:
    """One GPU configuration: every contender's to-GPU and back times, in one interleaved run.

    Args:
        num_rows: host table rows.
        dim: row length.
        num_ids: ids per step, drawn with replacement.
        dtype: ``torch.float32``, ``torch.bfloat16``, ...
        repeats: timed rounds (CUDA events).
        seed: for the ids and the values.

    Returns:
        ``{"config", "to_gpu", "from_gpu", "targets"}``; ``targets`` holds the
        :data:`GPU_TARGETS` ratios (None for SpeedTorch's without CuPy, with
        the reason in ``config["skipped"]``).

    Raises:
        BackendUnavailableError: torch sees no CUDA device.
    """
    generator = torch.Generator().manual_seed(seed)
    load = load_average()
    values = torch.randn(num_rows, dim, generator=generator).to(dtype)
    ids_cpu = torch.randint(0, num_rows, (num_ids,), generator=generator)
    ids_gpu = ids_cpu.cuda()
    consecutive = torch.arange(num_ids, device="cuda")  # the same bytes, contiguous in the table
    skipped = cupy_missing()
    # Without CuPy a pinned table's rows are staged, not moved by the kernel: named for what it is.
    contiguous = "(g) " + ("zero-copy kernel" if skipped is None else "staged copy") + ", consecutive rows"
    param = torch.empty(num_ids, dim, dtype=dtype, device="cuda")
    nbytes = param.numel() * param.element_size()

    table = ss.HostTable.empty(num_rows, dim, dtype=dtype, storage="pinned", backend="cuda")
    table.as_tensor().copy_(values)
    torch_pinned = values.pin_memory()
    gpu_table = values.cuda()
    host_block = torch.empty(num_ids, dim, dtype=dtype, pin_memory=True)
    device_block = torch.empty_like(param)

    def torch_to():
        param.copy_(torch_pinned[ids_cpu].cuda(non_blocking=True))

    def torch_from():
        torch_pinned.index_put_((ids_cpu,), param.cpu())

    to_gpu = {"speedswap": lambda: table.gather(ids_gpu, out=param),
              "(b) torch pinned": torch_to,
              "(c) all-GPU index_select": lambda: torch.index_select(gpu_table, 0, ids_gpu, out=param),
              "(d) pinned memcpy H2D": lambda: param.copy_(host_block, non_blocking=True),
              "(e) device-to-device copy": lambda: param.copy_(device_block),
              # The public call above checks the ids' range first, one host wait
              # inside the timed span; this is the transport alone.
              "(f) speedswap, ids checked before": lambda: table.gather_validated(ids_gpu, param),
              contiguous: lambda: table.gather_validated(consecutive, param)}
    from_gpu = {"speedswap": lambda: table.scatter(ids_gpu, param, check_unique=False),
                "(b) torch pinned": torch_from,
                "(c) all-GPU index_copy_": lambda: gpu_table.index_copy_(0, ids_gpu, param),
                "(d) pinned memcpy D2H": lambda: host_block.copy_(param, non_blocking=True),
                "(f) speedswap, ids checked before": lambda: table.scatter_validated(ids_gpu, param),
                contiguous: lambda: table.scatter_validated(consecutive, param)}
    if skipped is None:
        import cupy
        speedtorch, _keep = _speedtorch_table(cupy, values)
        ids_cupy = cupy.from_dlpack(ids_gpu)
        param_bits = param.view(_BITS.get(dtype, dtype))
        to_gpu["(a) SpeedTorch cupy"] = lambda: param_bits.copy_(torch.from_dlpack(speedtorch[ids_cupy]))

        def speedtorch_from():
            speedtorch[ids_cupy] = cupy.from_dlpack(param_bits)

        from_gpu["(a) SpeedTorch cupy"] = speedtorch_from
    del values  # every contender holds its own copy
    to_times = time_interleaved(to_gpu, repeats=repeats, cuda=True)
    from_times = time_interleaved(from_gpu, repeats=repeats, cuda=True)
    table.close()
    to_s = {k.split(" ")[0]: v["median_s"] for k, v in to_times.items()}
    from_s = {k.split(" ")[0]: v["median_s"] for k, v in from_times.items()}
    round_trip = {k: to_s[k] + from_s[k] for k in ("speedswap", "(a)", "(b)") if k in to_s}
    return {
        "config": {"num_rows": num_rows, "dim": dim, "num_ids": num_ids, "dtype": str(dtype).split(".")[1],
                   "row_bytes": dim * param.element_size(), "repeats": repeats,
                   "load_average_before": load, "skipped": {"(a) SpeedTorch cupy": skipped} if skipped else {}},
        "to_gpu": [_row(k, v, nbytes) for k, v in to_times.items()],
        "from_gpu": [_row(k, v, nbytes) for k, v in from_times.items()],
        "targets": {
            "gather_fraction_of_h2d": to_s["(d)"] / to_s["speedswap"],
            "scatter_fraction_of_d2h": from_s["(d)"] / from_s["speedswap"],
            "round_trip_vs_speedtorch": round_trip["(a)"] / round_trip["speedswap"] if skipped is None else None,
            "round_trip_vs_torch_pinned": round_trip["(b)"] / round_trip["speedswap"],
        },
    }


def run_gpu(num_rows: int = 1_000_000, num_ids: int = 131_072, repeats: int = 20) -> list:
    """Every :data:`GPU_CASES` configuration at ``num_rows`` x ``num_ids``; a list of :func:`run_gpu_case` results."""
    return [run_gpu_case(num_rows, dim, num_ids, dtype, repeats) for dim, dtype in GPU_CASES]


def format_cpu(result: dict) -> str:
    """The CPU figures of :func:`run_cpu` as text tables."""
    columns = _COLUMNS + ["vs_ref"]
    config = {k: v for k, v in result["config"].items() if k != "load_average_before"}
    return "\n".join([
        f"CPU transport: {config}",
        "\ngather (vs_ref = speed-up over torch.index_select)", format_table(result["gather"], columns),
        "\nscatter (vs_ref = speed-up over index_copy_)", format_table(result["scatter"], columns),
        "\nratios: " + ", ".join(f"{k} {v:.3g}" for k, v in result["targets"].items())])


def format_gpu(cases: list) -> str:
    """The GPU figures of :func:`run_gpu` as text tables, one pair per case."""
    parts = []
    for case in cases:
        config = case["config"]
        parts += [f"\nGPU transport: {config['num_ids']:,} of {config['num_rows']:,} rows x {config['dim']} "
                  f"{config['dtype']} ({config['row_bytes']} bytes per row)",
                  "to GPU", format_table(case["to_gpu"], _COLUMNS),
                  "from GPU", format_table(case["from_gpu"], _COLUMNS),
                  "ratios: " + ", ".join(f"{k} {'skipped' if v is None else f'{v:.3g}'}"
                                         for k, v in case["targets"].items())]
        parts += [f"skipped {name}: {why}" for name, why in config["skipped"].items()]
    return "\n".join(parts)
