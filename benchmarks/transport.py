"""Row transport: HostTable.gather/scatter against the obvious alternatives.

CPU (always): a 2,000,000 x 128 float32 table and 131,072 random ids.
HostTable.gather vs torch.index_select and np.take on a torch/numpy table,
HostTable.scatter vs index_copy_, all relative to a contiguous copy of the
same bytes (the memory bandwidth ceiling). The torch kernels also run on the
HostTable's own memory, which separates speedswap's per-call overhead from
the effect of how its memory is allocated (transparent huge pages).

GPU (when CUDA and CuPy are present): the SpeedTorch case, a 1,000,000 x 128
float32 host table and 131,072 ids drawn with replacement, moved to a CUDA
parameter and back. speedswap (pinned table, zero-copy kernels) vs
(a) SpeedTorch's method: CuPy fancy indexing on a CuPy array in pinned memory,
(b) a pinned torch CPU tensor indexed on the CPU, then .cuda() / .cpu() + index_put_,
(c) an all-GPU table with index_select / index_copy_,
(d) the limit: a pinned contiguous copy of the same bytes in each direction.
Then row sizes of 64, 256 and 1024 bytes and float16 storage. Scatters reuse
the gather's ids in every contender (as SpeedTorch's benchmark did): they
measure bytes moved, not which duplicate wins.

Usage:
    python benchmarks/transport.py            # full size, CPU (+ GPU when present)
    python benchmarks/transport.py --quick    # small sizes, a smoke run

Writes benchmarks/results/transport-{cpu,gpu}.json.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import speedswap as ss  # noqa: E402
from common import print_table, time_interleaved, write_results  # noqa: E402


def _row(name, summary, nbytes, reference=None):
    row = {"method": name, "median_ms": summary["median_s"] * 1e3,
           "min_ms": summary["min_s"] * 1e3, "max_ms": summary["max_s"] * 1e3,
           "GB/s": nbytes / summary["median_s"] / 1e9}
    if reference is not None:
        row["vs_ref"] = reference["median_s"] / summary["median_s"]
    return row


def run_cpu(num_rows=2_000_000, dim=128, num_ids=131_072, repeats=20, seed=0):
    """Measure CPU gather/scatter; returns ``{"config", "gather", "scatter", "targets"}``."""
    rng = np.random.default_rng(seed)
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
    result = {
        "config": {"num_rows": num_rows, "dim": dim, "num_ids": num_ids, "dtype": "float32",
                   "repeats": repeats},
        "gather": [_row(k, v, nbytes, gather["torch.index_select"]) for k, v in gather.items()],
        "scatter": [_row(k, v, nbytes, scatter["index_copy_"]) for k, v in scatter.items()],
    }
    copy_g, copy_s = gather["contiguous copy"]["median_s"], scatter["contiguous copy"]["median_s"]
    result["targets"] = {
        "gather_vs_index_select": gather["torch.index_select"]["median_s"] / gather["HostTable.gather"]["median_s"],
        "scatter_vs_index_copy": scatter["index_copy_"]["median_s"] / scatter["HostTable.scatter"]["median_s"],
        "scatter_unchecked_vs_index_copy":
            scatter["index_copy_"]["median_s"] / scatter["HostTable.scatter(check_unique=False)"]["median_s"],
        "gather_fraction_of_copy": copy_g / gather["HostTable.gather"]["median_s"],
        "scatter_fraction_of_copy": copy_s / scatter["HostTable.scatter"]["median_s"],
    }
    table.close()
    return result


def _cupy_pinned_array(cupy, shape, dtype):
    """A CuPy array whose memory is pinned host memory: SpeedTorch's table, without its global allocator swap."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    memory = cupy.cuda.PinnedMemory(nbytes, 1 | 2)  # portable | mapped
    pointer = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(memory.ptr, nbytes, memory), 0)
    return cupy.ndarray(shape, dtype=dtype, memptr=pointer), memory


def run_gpu_case(num_rows, dim, num_ids, dtype=np.float32, repeats=20, seed=0):
    """One GPU configuration: every contender's to-GPU and back times, in one interleaved run."""
    import cupy
    rng = np.random.default_rng(seed)
    tdtype = ss.convert.torch_dtype(dtype)
    values = rng.standard_normal((num_rows, dim)).astype(dtype)
    ids_np = rng.integers(0, num_rows, size=num_ids)
    ids_gpu = torch.from_numpy(ids_np).cuda()
    ids_cpu = torch.from_numpy(ids_np)
    param = torch.empty(num_ids, dim, dtype=tdtype, device="cuda")
    nbytes = num_ids * dim * np.dtype(dtype).itemsize

    table = ss.HostTable.from_numpy(values, storage="pinned", backend="cuda")
    speedtorch, _keep = _cupy_pinned_array(cupy, values.shape, dtype)
    speedtorch.set(values)
    ids_cupy = cupy.from_dlpack(ids_gpu)
    torch_pinned = torch.from_numpy(values).pin_memory()
    gpu_table = torch.from_numpy(values).cuda()
    host_block = torch.empty(num_ids, dim, dtype=tdtype).pin_memory()

    def speedtorch_to():
        param.copy_(torch.from_dlpack(speedtorch[ids_cupy]))

    def speedtorch_from():
        speedtorch[ids_cupy] = cupy.from_dlpack(param)

    def pytorch_to():
        param.copy_(torch_pinned[ids_cpu].cuda(non_blocking=True))

    def pytorch_from():
        torch_pinned.index_put_((ids_cpu,), param.cpu())

    to_gpu = time_interleaved({
        "speedswap": lambda: table.gather(ids_gpu, out=param),
        "(a) SpeedTorch cupy": speedtorch_to,
        "(b) torch pinned": pytorch_to,
        "(c) all-GPU index_select": lambda: torch.index_select(gpu_table, 0, ids_gpu, out=param),
        "(d) pinned memcpy H2D": lambda: param.copy_(host_block, non_blocking=True),
    }, repeats=repeats)
    from_gpu = time_interleaved({
        "speedswap": lambda: table.scatter(ids_gpu, param, check_unique=False),
        "(a) SpeedTorch cupy": speedtorch_from,
        "(b) torch pinned": pytorch_from,
        "(c) all-GPU index_copy_": lambda: gpu_table.index_copy_(0, ids_gpu, param),
        "(d) pinned memcpy D2H": lambda: host_block.copy_(param, non_blocking=True),
    }, repeats=repeats)
    to_ms = {k.split(" ")[0]: v["median_s"] for k, v in to_gpu.items()}
    from_ms = {k.split(" ")[0]: v["median_s"] for k, v in from_gpu.items()}
    total = {k: to_ms[k] + from_ms[k] for k in to_ms}
    table.close()
    return {
        "config": {"num_rows": num_rows, "dim": dim, "num_ids": num_ids, "dtype": np.dtype(dtype).name,
                   "row_bytes": dim * np.dtype(dtype).itemsize, "repeats": repeats},
        "to_gpu": [_row(k, v, nbytes) for k, v in to_gpu.items()],
        "from_gpu": [_row(k, v, nbytes) for k, v in from_gpu.items()],
        "targets": {
            "gather_fraction_of_h2d": to_ms["(d)"] / to_ms["speedswap"],
            "scatter_fraction_of_d2h": from_ms["(d)"] / from_ms["speedswap"],
            "round_trip_vs_speedtorch": total["(a)"] / total["speedswap"],
            "round_trip_vs_torch_pinned": total["(b)"] / total["speedswap"],
        },
    }


def run_gpu(quick=False, repeats=20):
    """The SpeedTorch case, then other row sizes and float16."""
    scale = 16 if quick else 1
    cases = [(1_000_000 // scale, 128, np.float32)]
    cases += [(1_000_000 // scale, row_bytes // 4, np.float32) for row_bytes in (64, 256, 1024)]
    cases += [(1_000_000 // scale, 128, np.float16)]
    return [run_gpu_case(n, dim, 131_072 // scale, dtype, repeats) for n, dim, dtype in cases]


def _print_cpu(result):
    print(f"CPU transport: {result['config']}")
    columns = ["method", "median_ms", "min_ms", "max_ms", "GB/s", "vs_ref"]
    print("\ngather (vs_ref = speedup over torch.index_select)")
    print_table(result["gather"], columns)
    print("\nscatter (vs_ref = speedup over index_copy_)")
    print_table(result["scatter"], columns)
    print("\ntargets:", {k: round(v, 3) for k, v in result["targets"].items()})


def _print_gpu(results):
    columns = ["method", "median_ms", "min_ms", "max_ms", "GB/s"]
    for case in results:
        print(f"\nGPU transport: {case['config']}")
        print("to GPU"); print_table(case["to_gpu"], columns)
        print("from GPU"); print_table(case["from_gpu"], columns)
        print("targets:", {k: round(v, 3) for k, v in case["targets"].items()})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-write", action="store_true", help="do not write the JSON result")
    args = parser.parse_args(argv)
    scale = 16 if args.quick else 1
    cpu = run_cpu(2_000_000 // scale, 128, 131_072 // scale, repeats=args.repeats)
    _print_cpu(cpu)
    payload = {"cpu": cpu}
    if "cuda" in ss.available_backends():
        payload["gpu"] = run_gpu(args.quick, args.repeats)
        _print_gpu(payload["gpu"])
    if not args.no_write:
        write_results("transport" + ("-quick" if args.quick else ""), payload)
    return payload


if __name__ == "__main__":
    main()
