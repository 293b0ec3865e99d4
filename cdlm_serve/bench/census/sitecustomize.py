"""A census of what a soaked server holds, taken inside the server once a minute.

`bench.soak --census FILE` puts this folder first on the server's PYTHONPATH, so Python imports
this file at start-up (the `site` module's sitecustomize hook) in whichever checkout's server it
starts, old or new: it imports nothing of cdlm_serve. With CDLM_SOAK_CENSUS set to a path, a
daemon thread appends one JSON line there every CDLM_SOAK_CENSUS_EVERY seconds (60):

- RSS and malloc's own counts (glibc's mallinfo2: bytes in use, free in the arenas, mmapped);
- every tensor Python can reach (`gc.get_objects`), de-duplicated by storage, summed by
  (shape, dtype): a holder shows as a group whose count steps up and stays;
- for the largest storages that were not there at the first census (the weights and the
  engines' own caches are), a few chains of who refers to them, as type and attribute names;
- after SIGUSR2 (`bench.soak --census-trace` sends it once the server is up), the lines whose
  Python allocations grew since (tracemalloc).

Malloc's bytes in use growing with the tensors is a holder; growing without them and without the
trace is native state (MKL's GEMM buffers, found with `heaptrack -p PID`, ...); RSS growing
while bytes in use stay is the allocator keeping free memory. This is how docs/deploy.md's
holders were found.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import sys
import threading
import time
import tracemalloc
import types

TOP_NEW = 8  # referrer chains for this many of the largest new storages, each census
CHAIN_DEPTH = 8
# gc.get_referrers scans every tracked object (~50 ms on a server): a budget per census keeps
# the GIL free for the server's own threads.
REFERRER_CALLS = 48


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc() -> dict[str, float]:
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    info.restype = _MallInfo2
    m = info()
    mb = 2**20
    return {
        "heap_in_use_mb": round(m.uordblks / mb, 1),
        "heap_free_mb": round(m.fordblks / mb, 1),
        "heap_arena_mb": round(m.arena / mb, 1),
        "mmapped_mb": round(m.hblkhd / mb, 1),
    }


def _rss_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key.lower() + "_mb"] = round(int(rest.split()[0]) / 1024, 1)
    return out


def _name_in(container: object, target: object) -> str:
    """How `container` holds `target`: a dict's key, a list's index, an object's attribute."""
    if isinstance(container, dict):
        for k, v in container.items():
            if v is target:
                return f"[{k!r}]"[:60]
    elif isinstance(container, (list, tuple)):
        for i, v in enumerate(container):
            if v is target:
                return f"[{i}]"
    elif isinstance(container, types.CellType):
        return "<cell>"
    elif isinstance(container, types.FrameType):
        code = container.f_code
        return f"<frame {code.co_name} {code.co_filename}:{container.f_lineno}>"
    else:
        for k, v in getattr(container, "__dict__", {}).items():
            if v is target:
                return f".{k}"
    return ""


def _step(r: object, o: object) -> tuple[object, str]:
    """One link of a chain: what refers to `o`, named so that a reader can find it in the
    code (the object owning a __dict__ rather than the dict, a generator's function)."""
    if isinstance(r, dict):
        owners = [x for x in gc.get_referrers(r) if getattr(x, "__dict__", None) is r]
        if owners:  # an object's __dict__: name the object and the attribute
            how = _name_in(r, o).strip("[]'")
            r = owners[0]
            return r, f"{type(r).__module__}.{type(r).__qualname__}.{how}"
    code = getattr(r, "gi_code", None) or getattr(r, "cr_code", None) or getattr(r, "ag_code", None)
    if code is not None:
        return r, f"<{type(r).__name__} {code.co_qualname} {code.co_filename}>"
    if isinstance(r, types.FunctionType):
        return r, f"<function {r.__qualname__} {r.__code__.co_filename}>"
    return r, f"{type(r).__module__}.{type(r).__qualname__}{_name_in(r, o)}"


def _chains(
    obj: object, ignore: set[int], budget: list[int], depth: int = CHAIN_DEPTH
) -> list[str]:
    """Up to 2 chains of referrers of `obj`, outermost last, as 'type.how' steps. Depth first,
    without recursion or closures: the walk's own frames, lists and tuples refer to the
    objects it visits, and must not show up as their holders."""
    out: list[str] = []
    mine = set(ignore)
    stack: list[tuple[object, tuple[str, ...], frozenset[int]]] = []
    mine.add(id(stack))
    first = (obj, (), frozenset({id(obj)}))
    stack.append(first)
    mine.add(id(first))
    while stack and len(out) < 2:
        o, path, seen = stack.pop()
        if budget[0] <= 0:
            out.append(" <- ".join([*path, "(out of budget)"]))
            break
        if isinstance(o, types.ModuleType):  # a module's global: the root of this chain
            out.append(" <- ".join(path))
            continue
        budget[0] -= 1
        refs = gc.get_referrers(o)
        mine.add(id(refs))
        refs = [
            r
            for r in refs
            if id(r) not in mine
            and id(r) not in seen
            and not (isinstance(r, types.FrameType) and r.f_code.co_filename == __file__)
        ]
        mine.add(id(refs))
        if len(path) >= depth or not refs:
            out.append(" <- ".join(path))
            continue
        for r in reversed(refs[:2]):
            holder, step = _step(r, o)
            entry = (holder, (*path, step), seen | {id(holder)})
            mine.add(id(entry))
            stack.append(entry)
        del o
    return out


def _objects_by_type(objs: list[object], top: int = 25) -> dict[str, list[float]]:
    """The Python objects the collector tracks, by type: [count, MB by sys.getsizeof] for the
    `top` largest types (a holder of many small objects shows here, not among the tensors;
    getsizeof counts an object's own allocation, not what it refers to)."""
    sizes: dict[str, list[float]] = {}
    for o in objs:
        t = type(o)
        entry = sizes.setdefault(f"{t.__module__}.{t.__qualname__}", [0, 0.0])
        entry[0] += 1
        with contextlib.suppress(TypeError):  # a type whose __sizeof__ misbehaves
            entry[1] += sys.getsizeof(o) / 2**20
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1][1])[:top]
    return {k: [v[0], round(v[1], 2)] for k, v in ranked}


def census(first: dict[int, int] | None) -> tuple[dict, dict[int, int]]:
    import torch

    # No gc.collect(): a census must not free what the server would have kept (a cycle that
    # holds a cache until the collector runs is worth seeing too).
    objs = gc.get_objects()
    storages: dict[tuple[str, int], dict] = {}
    for o in objs:
        # type(), not isinstance(): the latter reads __class__, which some deprecated module
        # proxies answer with a warning.
        if not issubclass(type(o), torch.Tensor) or o.is_meta:
            continue
        try:
            st = o.untyped_storage()
            key = (str(st.device), st.data_ptr())
        except (RuntimeError, NotImplementedError):
            continue
        if key[1] == 0:
            continue
        entry = storages.setdefault(key, {"bytes": st.nbytes(), "tensors": []})
        entry["tensors"].append(o)
    groups: dict[str, list[float]] = {}
    for entry in storages.values():
        # Named after its largest view (the whole buffer, where Python holds it).
        entry["tensors"].sort(key=lambda t: -t.numel())
        t = entry["tensors"][0]
        name = f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} {t.device}"
        g = groups.setdefault(name, [0, 0.0])
        g[0] += 1
        g[1] += entry["bytes"] / 2**20
    now = {key[1]: entry["bytes"] for key, entry in storages.items()}
    row: dict = {"t": round(time.time(), 1), **_rss_mb(), **_malloc()}
    row["tensors_mb"] = round(sum(e["bytes"] for e in storages.values()) / 2**20, 1)
    row["storages"] = len(storages)
    row["groups"] = {k: [v[0], round(v[1], 2)] for k, v in groups.items() if v[1] >= 0.5}
    row["objects"] = _objects_by_type(objs)
    if first is not None:
        new = [e for k, e in storages.items() if k[1] not in first]
        row["new_mb"] = round(sum(e["bytes"] for e in new) / 2**20, 1)
        ignore = {id(objs), id(storages), id(new)} | {id(e) for e in storages.values()}
        ignore |= {id(e["tensors"]) for e in storages.values()}
        top, budget = [], [REFERRER_CALLS]
        for e in sorted(new, key=lambda e: -e["bytes"])[:TOP_NEW]:
            t = e["tensors"][0]
            top.append(
                {
                    "mb": round(e["bytes"] / 2**20, 2),
                    "tensor": f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}",
                    "held_by": _chains(t, ignore | {id(e["tensors"])}, budget),
                }
            )
        row["new_top"] = top
    if _TRACE["baseline"] is not None:
        row["traced_new"] = _traced_new(_TRACE["baseline"])
    del objs, storages
    return row, now


# Python's own allocations since a baseline (SIGUSR2): tracing from start-up triples the
# server's start, so the soak starts it once the server is up and before the load, and each
# census then lists the lines whose live allocations grew since. Native heaps (torch's C++,
# tokenizers' Rust) are not traced: what grows in malloc's in-use bytes and not here is theirs.
_TRACE: dict = {"baseline": None}
TRACE_TOP = 15


def _start_trace(signum: int, frame: object) -> None:
    if not tracemalloc.is_tracing():
        tracemalloc.start(int(os.environ.get("CDLM_SOAK_TRACE_FRAMES", 6)))
        _TRACE["baseline"] = tracemalloc.take_snapshot()


def _where(f: tracemalloc.Frame) -> str:
    return f"{f.filename.rsplit('/site-packages/', 1)[-1]}:{f.lineno}"


def _traced_new(baseline: tracemalloc.Snapshot) -> dict:
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    diff = snap.compare_to(baseline, "traceback")
    top = []
    for d in diff[:TRACE_TOP]:
        if d.size_diff <= 0:
            break
        top.append(
            {
                "mb": round(d.size_diff / 2**20, 2),
                "count": d.count_diff,
                "at": [_where(f) for f in d.traceback],
            }
        )
    total = sum(s.size for s in snap.statistics("filename")) / 2**20
    return {"total_mb": round(total, 1), "top": top}


def _loop(path: str, every: float) -> None:
    first: dict[int, int] | None = None
    started = time.monotonic()
    while True:
        time.sleep(every)
        try:
            row, now = census(first)
        except Exception as e:  # a census never takes the server down
            row, now = {"t": round(time.time(), 1), "error": repr(e)}, first or {}
        row["uptime_s"] = round(time.monotonic() - started)
        if first is None:
            first = now  # the weights and the engines' caches, once the first requests ran
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


if os.environ.get("CDLM_SOAK_CENSUS"):
    with contextlib.suppress(ValueError):  # not in the main thread: no trace, the rest runs
        signal.signal(signal.SIGUSR2, _start_trace)
    threading.Thread(
        target=_loop,
        args=(os.environ["CDLM_SOAK_CENSUS"], float(os.environ.get("CDLM_SOAK_CENSUS_EVERY", 60))),
        name="soak-census",
        daemon=True,
    ).start()
