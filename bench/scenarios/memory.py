# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 4: worker memory. The kernel holds a 1 GiB array (every page written,
# so resident) before launching. Each worker forms the group (Accelerator where
# the system has one), reads one byte of every page of the array (a read must
# not copy a copy-on-write page), does an all-reduce and a barrier, then reports
# its own USS / PSS / RSS (psutil memory_full_info). USS = memory only this worker
# holds: a copied array would show up there as ~1 GiB.
import numpy as np
import psutil

MEM_BYTES = 1 << 30
MEM_PAGE = 4096


def mem_alloc():
    global MEM_ARRAY
    MEM_ARRAY = np.ones(MEM_BYTES, dtype=np.uint8)  # np.ones writes every page


def mem_free():
    global MEM_ARRAY
    MEM_ARRAY = None


def mem_report(out_dir):
    checksum = int(MEM_ARRAY[::MEM_PAGE].sum())  # touch every page, read-only
    info = psutil.Process().memory_full_info()
    bench_put(
        out_dir,
        uss_mb=info.uss / 2**20,
        pss_mb=info.pss / 2**20,
        rss_mb=info.rss / 2**20,
        pages_read=checksum,
    )


def mem_raw(out_dir):
    launch_fn_raw()
    mem_report(out_dir)


def mem_nbaccel(out_dir):
    launch_fn_nbaccel()
    mem_report(out_dir)


def mem_accelerate(out_dir):
    launch_fn_accelerate()
    mem_report(out_dir)


def mem_fabric(fabric, out_dir):
    launch_fn_fabric(fabric)
    mem_report(out_dir)


def bench_memory_once(system):
    """{rank: {uss_mb, pss_mb, rss_mb}} of one launch with ``system`` (array must exist)."""
    with bench_outdir() as out:
        if system == "raw":
            raw_launch(mem_raw, (out,))
        elif system == "nbaccel":
            nbaccel_launch(mem_nbaccel, (out,))
        elif system == "accelerate":
            accelerate_launch(mem_accelerate, (out,))
        elif system == "fabric":
            fabric_launch(mem_fabric, (out,))
        else:
            raise ValueError(system)
        ranks = bench_take(out)
    kernel = psutil.Process().memory_full_info()
    return {
        "ranks": ranks,
        "max_uss_mb": max(r["uss_mb"] for r in ranks.values()),
        "max_pss_mb": max(r["pss_mb"] for r in ranks.values()),
        "kernel_rss_mb": kernel.rss / 2**20,
    }
