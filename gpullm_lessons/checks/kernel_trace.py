"""See your own kernel: run a Numba kernel once in the CUDA simulator and record every memory access it makes.

    from gpullm_lessons import viz
    from gpullm_lessons.checks import kernel_trace
    t = kernel_trace.trace(my_launcher, x, out)   # calls my_launcher(x, out) once, in the simulator, and records
    print(t.summary())                            # who wrote what, loads per thread, coalescing, shared memory
    t.plot()                                      # the same as four pictures per kernel launch
    viz.show_kernel(my_launcher, x, out)          # all of the above in one call
    viz.show_kernel(softmax_backward_numba, op="softmax_backward")   # tiny inputs of a course op made for you

`fn` is your launcher (a Python function that launches kernels) or a configured kernel (`my_kernel[2, 32]`);
the arguments are NumPy arrays, simulator device arrays and scalars, exactly as you would call it. Use a tiny
input (a few blocks of 32 threads): every simulated CUDA thread runs its kernel in Python. A (block, thread) pair is
(blockIdx.x, threadIdx.x) for a 1-D launch and a pair of tuples (x, y) for a 2-D one.

How: while fn runs, the simulator's array indexing, `cuda.shared.array`, atomics and kernel launches are wrapped
so that each element access is logged with the indices of the simulated thread making it; the wrappers are
removed when fn returns or raises, so kernels run outside `trace` exactly as before.

What is recorded, per access: the launch, blockIdx and threadIdx of the thread, the array (named after your
arguments or the kernel's parameters), the element index, a byte address (arrays are placed at 256-byte aligned
addresses, as cudaMalloc does), load / store / atomic, global or shared memory, and a per-thread counter k
(this thread's k-th global load, k-th shared store, ...).

What it tells you:

- ``writer[name]``: for every element of an output, the (block, thread) that wrote it (None: never written; a
  list: several threads wrote it in the same launch, a race unless they used atomics). ``unwritten`` and
  ``multiple_writers`` list the problems.
- ``reads_per_thread``: global loads per (block, thread).
- ``sectors_per_warp_load()``: the lanes of a warp execute a load together. Grouping the k-th global load of
  every lane of a warp gives one warp-wide load; the memory system serves it in 32-byte sectors. 32 lanes reading
  32 neighbouring float32 values (128 bytes) touch 4 sectors: coalesced. 32 lanes reading 32 different rows
  touch 32 sectors: 8 times the traffic for the same bytes.
- ``shared_traffic``: shared-memory loads and stores per block, and bank conflicts (32 banks of 4 bytes: lanes of
  one warp access that hit different 4-byte words of the same bank are served one after the other).

Limits: only in the simulator (on a real GPU, `trace` says so and runs nothing). Grouping lanes by their k-th
access models lanes that run in lockstep; lanes whose branches diverge are grouped by count, not by line.
Memory is not cached here, so the numbers are what the kernel asks for, not what a profiler measures.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import linecache
import math
import operator
import re
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..runtime import simwarp

SECTOR = 32          # bytes per memory sector (the unit global loads are served in)
BANKS = 32           # shared-memory banks
BANK_BYTES = 4       # bytes per bank word
ALIGN = 256          # global arrays are placed at 256-byte aligned addresses, as cudaMalloc does
SIM_ONLY = ("kernel tracing runs in Numba's CUDA simulator only: this session runs Numba kernels on the GPU, so "
            "nothing was traced (start Python with GPULLM_DEVICE=sim to see your kernel's accesses)")

GLOBAL, SHARED = 0, 1
READ, WRITE, ATOMIC = 0, 1, 2
_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "float64": "fp64", "int32": "int32", "int64": "int64"}

_REC: Optional["_Recorder"] = None     # the trace being recorded (one at a time, like the simulator's kernels)
_ATOMICS = ("add", "sub", "and_", "or_", "xor", "inc", "dec", "exch", "max", "min", "nanmax", "nanmin", "cas",
            "compare_and_swap")


# ------------------------------------------------------------------------------------------------------------
# What the trace holds
# ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch made by the traced call."""
    index: int
    kernel: str
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def n_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def one_d(self) -> bool:
        return self.grid[1:] == (1, 1) and self.block[1:] == (1, 1)

    def block_index(self, b: int):
        """blockIdx of the linear block number b: an int for 1-D launches, else a tuple (x, y[, z])."""
        gx, gy, _ = self.grid
        x, y, z = b % gx, (b // gx) % gy, b // (gx * gy)
        return x if self.one_d else _trim((x, y, z), self.grid, self.block)

    def thread_index(self, t: int):
        bx, by, _ = self.block
        x, y, z = t % bx, (t // bx) % by, t // (bx * by)
        return x if self.one_d else _trim((x, y, z), self.grid, self.block)

    def who(self, b: int, t: int):
        return (self.block_index(b), self.thread_index(t))

    def __str__(self):
        g = self.grid[0] if self.one_d else _trim(self.grid, self.grid, self.block)
        k = self.block[0] if self.one_d else _trim(self.block, self.grid, self.block)
        return f"{self.kernel}[{g}, {k}]"


def _trim(xyz, grid, block):
    dims = 3 if (grid[2] > 1 or block[2] > 1) else 2
    return tuple(int(v) for v in xyz[:dims])


@dataclasses.dataclass
class ArrayInfo:
    """An array the kernels touched: its name, shape and dtype, and where it sits (virtual byte addresses)."""
    id: int
    name: str
    space: str                 # "global" | "shared"
    shape: Tuple[int, ...]
    dtype: np.dtype
    vbase: int                 # virtual address of its first byte (global) or offset in the block's shared memory
    ptr: int = 0               # where its first element lives in this process (to map accesses back to it)
    nbytes: int = 0
    order: str = "C"           # "C" | "F" | "" (not contiguous: indices are flat element offsets)
    provisional: bool = False  # named argN for want of a better name: the first kernel parameter renames it

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def index_of(self, vaddr: int):
        """The element index (an int for 1-D, a tuple otherwise) at virtual address vaddr."""
        flat = (int(vaddr) - self.vbase) // self.itemsize
        if not self.order or len(self.shape) <= 1:
            return int(flat)
        return tuple(int(i) for i in np.unravel_index(flat, self.shape, order=self.order))

    @property
    def size(self) -> int:
        if not self.order:
            return self.nbytes // self.itemsize
        return int(np.prod(self.shape)) if self.shape else 1


@dataclasses.dataclass
class SectorStats:
    """Warp-wide loads (or stores) and the 32-byte sectors each touched."""
    kind: str                           # "load" | "store"
    mean: float                         # sectors per warp access, averaged over all of them (nan if none)
    ideal: float                        # sectors the same accesses need at best, averaged (their bytes / 32)
    full_warp_ideal: float              # a full warp of the dominant element size, coalesced: 32 * itemsize / 32
    dtype: Optional[np.dtype]           # the dominant element type of these accesses
    histogram: Dict[int, int]           # sectors -> number of warp accesses
    accesses: List[dict]                # one dict per warp access: launch, block, warp, k, lanes, sectors, ideal

    @property
    def count(self) -> int:
        return len(self.accesses)

    def _fullest(self):
        lanes = max(a["lanes"] for a in self.accesses)
        return [a for a in self.accesses if a["lanes"] == lanes]

    def waste(self) -> float:
        """Sectors touched / sectors needed, over the fullest warp accesses (so that a few partly idle edge warps
        neither hide nor fake a coalescing problem). 1.0: every byte of every sector fetched is used."""
        if not self.accesses:
            return float("nan")
        rows = self._fullest()
        return sum(a["sectors"] for a in rows) / sum(a["ideal"] for a in rows)

    def uncoalesced(self) -> bool:
        """True when the fullest warp accesses touch over 1.5x the sectors their bytes need even when the bytes
        start mid-sector (one extra sector allowed): lanes far apart, not just a misaligned row."""
        if not self.accesses:
            return False
        rows = self._fullest()
        return sum(a["sectors"] for a in rows) > 1.5 * sum(a["ideal"] + 1 for a in rows)

    def __str__(self):
        if not self.accesses:
            return f"no global {self.kind}s"
        return (f"{self.count} warp {self.kind}s, {self.mean:.1f} sectors on average (ideal "
                f"{self.full_warp_ideal:g}); distribution {dict(sorted(self.histogram.items()))}")


class KernelTrace:
    """What the traced call's kernels did. Attributes aggregate over every launch; `launch(i)` narrows to one.

    available: False when nothing was traced (a GPU session); `message` says why.
    error: the exception the traced call raised (None if it ran through); accesses before it are kept.
    launches: the kernel launches, in order. arrays: the arrays touched (global and shared), by id.
    records: a NumPy structured array, one row per access (launch, space, kind, block, thread, k, array, addr).
    """

    def __init__(self, records, launches, arrays, available=True, message="", error=None, warp_size=32,
                 fn_name=""):
        self.records = records
        self.launches: List[Launch] = launches
        self.arrays: Dict[int, ArrayInfo] = arrays
        self.available = available
        self.message = message
        self.error = error
        self.warp_size = int(warp_size)
        self.fn_name = fn_name
        self._cache: Dict[str, Any] = {}

    # -- narrowing ------------------------------------------------------------------------------------------
    def launch(self, i: int) -> "KernelTrace":
        """The trace of launch i alone (same API)."""
        key = f"launch{i}"
        if key not in self._cache:
            if len(self.launches) == 1 and self.launches[0].index == i:
                return self
            L = next(L for L in self.launches if L.index == i)
            sel = self.records[self.records["launch"] == i]
            self._cache[key] = KernelTrace(sel, [L], self.arrays, self.available, self.message, self.error,
                                           self.warp_size, self.fn_name)
        return self._cache[key]

    def _by_launch(self):
        return [(L, self.records[self.records["launch"] == L.index]) for L in self.launches]

    def _select(self, space=None, kind=None, rec=None):
        r = self.records if rec is None else rec
        m = np.ones(len(r), bool)
        if space is not None:
            m &= r["space"] == space
        if kind is not None:
            m &= np.isin(r["kind"], kind) if isinstance(kind, tuple) else (r["kind"] == kind)
        return r[m]

    # -- writes ---------------------------------------------------------------------------------------------
    def _writes(self):
        """Per output array: element flat index -> per launch the distinct writers, and atomic flags."""
        if "writes" in self._cache:
            return self._cache["writes"]
        out = {}
        for L, rec in self._by_launch():
            w = self._select(GLOBAL, (WRITE, ATOMIC), rec)
            for aid in np.unique(w["array"]):
                a = self.arrays[int(aid)]
                wa = w[w["array"] == aid]
                flat = (wa["addr"] - a.vbase) // a.itemsize
                entry = out.setdefault(a.name, {"array": a, "launches": []})
                per = {}
                for f, b, t, k in zip(flat.tolist(), wa["block"].tolist(), wa["thread"].tolist(), wa["kind"].tolist()):
                    s = per.setdefault(f, [set(), False])
                    s[0].add((b, t))
                    s[1] |= k == ATOMIC
                entry["launches"].append((L, per))
        self._cache["writes"] = out
        return out

    @property
    def outputs(self) -> List[str]:
        """Names of the global arrays that were written (stored to or updated with atomics)."""
        return list(self._writes())

    @property
    def writer(self) -> Dict[str, np.ndarray]:
        """name -> object array shaped like the output: (block, thread) of the thread that wrote each element,
        None where nothing wrote it, a list of (block, thread) where several threads wrote it in one launch (atomic
        updates included). With several launches writing an array, the last launch's writers are kept."""
        if "writer" in self._cache:
            return self._cache["writer"]
        res = {}
        for name, e in self._writes().items():
            a = e["array"]
            grid = np.empty(a.size, dtype=object)
            for L, per in e["launches"]:
                for f, (who, _) in per.items():
                    if 0 <= f < a.size:
                        ws = sorted(who)
                        grid[f] = L.who(*ws[0]) if len(ws) == 1 else [L.who(b, t) for b, t in ws]
            res[name] = grid.reshape(a.shape, order=a.order) if a.order else grid
        self._cache["writer"] = res
        return res

    @property
    def multiple_writers(self) -> Dict[str, List[tuple]]:
        """name -> [(index, [(block, thread), ...]), ...]: elements stored by several threads in one launch
        without atomics (a race: which value lands is up to the hardware)."""
        res = {}
        for name, e in self._writes().items():
            a = e["array"]
            rows = []
            for L, per in e["launches"]:
                for f, (who, atomic) in sorted(per.items()):
                    if len(who) > 1 and not atomic:
                        rows.append((a.index_of(a.vbase + f * a.itemsize), [L.who(b, t) for b, t in sorted(who)]))
            if rows:
                res[name] = rows
        return res

    @property
    def shared_hazards(self) -> List[dict]:
        """Shared-memory slots that one thread of a block wrote and another read between the same two
        cuda.syncthreads(): a missing barrier (on a GPU the read may see the slot before or after the write). Two
        threads that only write a slot (the same value, often) are left out. One dict per slot, in the order of the
        first access: launch, kernel, block, array, index, writer and reader (block, thread), read_first (the read
        came first here)."""
        if "hazards" in self._cache:
            return self._cache["hazards"]
        r = self._select(SHARED, (READ, WRITE))
        res = []
        if len(r):
            keys = np.stack([r["launch"], r["block"], r["array"], r["addr"], r["barrier"]], axis=1).astype(np.int64)
            _, group = np.unique(keys, axis=0, return_inverse=True)
            group = np.asarray(group).reshape(-1)
            n = int(group.max()) + 1
            thread = r["thread"].astype(np.int64)
            big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
            span = {}
            for kind in (WRITE, READ):
                sel = r["kind"] == kind
                lo, hi = np.full(n, big), np.full(n, small)
                np.minimum.at(lo, group[sel], thread[sel])
                np.maximum.at(hi, group[sel], thread[sel])
                span[kind] = (lo, hi)
            (wlo, whi), (rlo, rhi) = span[WRITE], span[READ]
            own = (wlo == whi) & (rlo == rhi) & (rlo == wlo)        # one thread reads what it wrote itself
            bad = np.flatnonzero((wlo != big) & (rlo != big) & ~own)
            first = np.full(n, len(r))
            np.minimum.at(first, group, np.arange(len(r)))
            for g in bad[np.argsort(first[bad])]:
                rows = r[group == g]
                is_w = rows["kind"] == WRITE
                # a write and a read of the slot by two threads with no barrier between them: another warp's
                # thread, or a lane of the same warp with no cuda.syncwarp() between the two
                pair = next(((i, j) for j in np.flatnonzero(~is_w) for i in np.flatnonzero(is_w)
                             if rows["thread"][i] != rows["thread"][j]
                             and (rows["thread"][i] // self.warp_size != rows["thread"][j] // self.warp_size
                                  or rows["wbarrier"][i] == rows["wbarrier"][j])), None)
                if pair is None:
                    continue
                w, j = rows[pair[0]], pair[1]
                L = next(L for L in self.launches if L.index == int(w["launch"]))
                a = self.arrays[int(w["array"])]
                flat = (int(w["addr"]) - a.vbase) // a.itemsize
                index = tuple(int(i) for i in np.unravel_index(flat, a.shape)) if len(a.shape) > 1 else int(flat)
                res.append({"launch": L.index, "kernel": L.kernel, "block": L.block_index(int(w["block"])),
                            "array": a.name, "index": index,
                            "writer": L.who(int(w["block"]), int(w["thread"])),
                            "reader": L.who(int(rows[j]["block"]), int(rows[j]["thread"])),
                            "read_first": bool(j < np.flatnonzero(is_w)[0])})
        self._cache["hazards"] = res
        return res

    @property
    def atomic_outputs(self) -> Dict[str, int]:
        """name -> the most threads that updated one element with atomics (in one launch)."""
        res = {}
        for name, e in self._writes().items():
            most = max((len(who) for _, per in e["launches"] for who, atomic in per.values() if atomic), default=0)
            if most:
                res[name] = most
        return res

    @property
    def unwritten(self) -> Dict[str, List]:
        """name -> indices of the output's elements that no launch wrote (outputs: arrays written at least once)."""
        res = {}
        for name, e in self._writes().items():
            a = e["array"]
            seen = np.zeros(a.size, bool)
            for _, per in e["launches"]:
                idx = np.fromiter(per.keys(), dtype=np.int64, count=len(per))
                seen[idx[(idx >= 0) & (idx < a.size)]] = True
            missing = np.flatnonzero(~seen)
            if len(missing):
                res[name] = [a.index_of(a.vbase + int(f) * a.itemsize) for f in missing]
        return res

    def _elements_per_thread(self, L, rec):
        """Distinct output elements written per thread of launch L: array (n_blocks, threads_per_block)."""
        counts = np.zeros((L.n_blocks, L.threads_per_block), np.int64)
        w = self._select(GLOBAL, (WRITE, ATOMIC), rec)
        if len(w):
            key = np.unique(np.stack([w["block"].astype(np.int64), w["thread"].astype(np.int64),
                                      w["array"].astype(np.int64), w["addr"]], 1), axis=0)
            np.add.at(counts, (key[:, 0], key[:, 1]), 1)
        return counts

    # -- reads ----------------------------------------------------------------------------------------------
    def _per_thread(self, space, kind):
        res: Dict[tuple, int] = {}
        for L, rec in self._by_launch():
            r = self._select(space, kind, rec)
            counts = np.zeros((L.n_blocks, L.threads_per_block), np.int64)
            np.add.at(counts, (r["block"].astype(np.int64), r["thread"].astype(np.int64)), 1)
            for b in range(L.n_blocks):
                for t in range(L.threads_per_block):
                    key = L.who(b, t)
                    res[key] = res.get(key, 0) + int(counts[b, t])
        return res

    @property
    def reads_per_thread(self) -> Dict[tuple, int]:
        """(block, thread) -> global loads that thread made (summed over launches; atomics not counted)."""
        return self._per_thread(GLOBAL, READ)

    @property
    def writes_per_thread(self) -> Dict[tuple, int]:
        """(block, thread) -> global stores that thread made (atomics not counted)."""
        return self._per_thread(GLOBAL, WRITE)

    def _load_matrix(self, L, rec):
        r = self._select(GLOBAL, READ, rec)
        counts = np.zeros((L.n_blocks, L.threads_per_block), np.int64)
        np.add.at(counts, (r["block"].astype(np.int64), r["thread"].astype(np.int64)), 1)
        return counts

    # -- coalescing -----------------------------------------------------------------------------------------
    def _warp_groups(self, r, extra=()):
        """One group per warp-wide access (launch, block, warp, *extra, k): (group id per record, the groups' keys)."""
        if not len(r):
            return np.zeros(0, np.int64), np.zeros((0, 4 + len(extra)), np.int64)
        cols = [r["launch"].astype(np.int64), r["block"].astype(np.int64),
                r["thread"].astype(np.int64) // self.warp_size, *[r[c].astype(np.int64) for c in extra],
                r["k"].astype(np.int64)]
        radix = [int(c.max()) + 1 for c in cols]
        key = np.zeros(len(r), np.int64)
        for c, n in zip(cols, radix):          # one int64 per (launch, block, warp, ..., k): mixed radix
            key = key * n + c
        uniq, inv = np.unique(key, return_inverse=True)
        uk = np.empty((len(uniq), len(cols)), np.int64)
        rest = uniq
        for j in range(len(cols) - 1, -1, -1):
            rest, uk[:, j] = np.divmod(rest, radix[j])
        return inv.reshape(-1), uk

    def sectors_per_warp_load(self, kind: str = "load") -> SectorStats:
        """Group the k-th global load of every lane of each warp into one warp-wide load and count the distinct
        32-byte sectors it touches. kind="store" does the same for stores. Returns SectorStats (mean, ideal,
        histogram, one row per warp access)."""
        key = "sectors_" + kind
        if key in self._cache:
            return self._cache[key]
        code = {"load": READ, "store": WRITE}[kind]
        r = self._select(GLOBAL, code)
        rows = []
        dtype = None
        if len(r):
            g, uk = self._warp_groups(r)
            G = len(uk)
            addr, size = r["addr"].astype(np.int64), r["size"].astype(np.int64)
            lo, hi = addr // SECTOR, (addr + size - 1) // SECTOR
            span = int(max(hi.max(), 0)) + 1
            pairs = np.unique(np.concatenate([g * span + lo, g * span + hi]))
            sectors = np.bincount(pairs // span, minlength=G)
            amax = int(addr.max()) + 1
            _, first = np.unique(g * amax + addr, return_index=True)
            need = np.bincount(g[first], weights=size[first], minlength=G).astype(np.int64)
            lanes = np.bincount(g, minlength=G)
            ideal = np.maximum(1, -(-need // SECTOR))
            rows = [{"launch": int(a), "block": int(b), "warp": int(w), "k": int(k), "lanes": int(n),
                     "sectors": int(s), "ideal": int(i), "bytes": int(nb)}
                    for (a, b, w, k), n, s, i, nb in zip(uk.tolist(), lanes, sectors, ideal, need)]
            # the element type that carries the most distinct bytes (not the most loads: a table every lane
            # reads at one address would win by count)
            distinct = np.unique(np.stack([r["array"].astype(np.int64), addr], 1), axis=0)
            by_type: Dict[np.dtype, int] = {}
            for aid, n in zip(*np.unique(distinct[:, 0], return_counts=True)):
                dt = self.arrays[int(aid)].dtype
                by_type[dt] = by_type.get(dt, 0) + int(n) * dt.itemsize
            dtype = max(by_type, key=by_type.get)
        hist: Dict[int, int] = {}
        for row in rows:
            hist[row["sectors"]] = hist.get(row["sectors"], 0) + 1
        full = max(self.warp_size * dtype.itemsize / SECTOR, 1.0) if dtype is not None else float("nan")
        mean = float(np.mean([x["sectors"] for x in rows])) if rows else float("nan")
        ideal = float(np.mean([x["ideal"] for x in rows])) if rows else float("nan")
        res = SectorStats(kind, mean, ideal, full, dtype, hist, rows)
        self._cache[key] = res
        return res

    # -- shared memory --------------------------------------------------------------------------------------
    def _bank_ways(self):
        """Per warp-wide shared load or store: (launch, block, ways); ways = the most distinct 4-byte words that
        fall in one bank (1: no conflict, served in one pass)."""
        if "banks" in self._cache:
            return self._cache["banks"]
        r = self._select(SHARED, (READ, WRITE))
        res = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        if len(r):
            g, uk = self._warp_groups(r, extra=("kind",))
            G = len(uk)
            words = r["addr"].astype(np.int64) // BANK_BYTES
            wmax = int(words.max()) + 1
            pairs = np.unique(g * wmax + words)
            pg, pw = pairs // wmax, pairs % wmax
            ways = np.bincount(pg * BANKS + pw % BANKS, minlength=G * BANKS).reshape(G, BANKS).max(1)
            res = (uk[:, 0], uk[:, 1], ways)
        self._cache["banks"] = res
        return res

    @property
    def shared_traffic(self) -> Dict[Any, dict]:
        """blockIdx -> {"loads", "stores", "atomics": shared accesses by all its threads; "warp_accesses": warp-wide
        shared loads + stores; "conflicted": how many of them had bank conflicts; "max_ways": the worst (2 = two
        words of one bank, served in two passes); "extra_passes": sum of (ways - 1)}. Summed over launches."""
        if "shared" in self._cache:
            return self._cache["shared"]
        res: Dict[Any, dict] = {}
        launch_of, block_of, ways = self._bank_ways()
        for L, rec in self._by_launch():
            r = self._select(SHARED, None, rec)
            if not len(r):
                continue
            nb = L.n_blocks
            per_kind = [np.bincount(r["block"][r["kind"] == k], minlength=nb) for k in (READ, WRITE, ATOMIC)]
            mine = launch_of == L.index
            b_w, w_w = block_of[mine], ways[mine]
            acc = np.bincount(b_w, minlength=nb)
            bad = np.bincount(b_w, weights=w_w > 1, minlength=nb)
            extra = np.bincount(b_w, weights=w_w - 1, minlength=nb)
            worst = np.ones(nb, np.int64)
            np.maximum.at(worst, b_w, w_w)
            for b in range(nb):
                d = res.setdefault(L.block_index(b), {"loads": 0, "stores": 0, "atomics": 0, "warp_accesses": 0,
                                                      "conflicted": 0, "max_ways": 1, "extra_passes": 0})
                d["loads"] += int(per_kind[0][b])
                d["stores"] += int(per_kind[1][b])
                d["atomics"] += int(per_kind[2][b])
                d["warp_accesses"] += int(acc[b])
                d["conflicted"] += int(bad[b])
                d["max_ways"] = max(d["max_ways"], int(worst[b]))
                d["extra_passes"] += int(extra[b])
        self._cache["shared"] = res
        return res

    # -- text -----------------------------------------------------------------------------------------------
    def summary(self) -> str:
        """A few lines a learner can read: who wrote what, loads, coalescing, shared memory, problems."""
        if not self.available:
            return self.message
        lines = []
        if self.error is not None:
            e = self.error
            if isinstance(e, NotImplementedError):
                lines.append(f"not attempted: {self.fn_name or 'the function'} raised NotImplementedError "
                             f"(write it first)")
            else:
                lines.append(f"the call raised {type(e).__name__}: {str(e)[:300]}"
                             + (" (below: what ran before it)" if self.launches else ""))
        if not self.launches:
            if self.error is None:
                lines.append(f"no kernel was launched ({self.fn_name or 'the function'} ran without launching a "
                             f"Numba kernel)")
            elif not isinstance(self.error, NotImplementedError):
                lines.append("no kernel was launched before the error")
            return "\n".join(lines)
        if len(self.launches) == 1:
            lines.extend(self._launch_summary())
        else:
            lines.append(f"{len(self.launches)} kernel launches:")
            for L in self.launches:
                for j, s in enumerate(self.launch(L.index)._launch_summary(problems=False)):
                    lines.append(("  " if j == 0 else "    ") + s)
            problems = self._problems()
            if problems:
                lines.append("after all launches: " + "; ".join(problems))
        return "\n".join(lines)

    def _problems(self) -> List[str]:
        """Elements never written (by any launch) and elements several threads stored in one launch."""
        problems = []
        for name, idx in self.unwritten.items():
            a = self.arrays_by_name()[name]
            problems.append(f"{len(idx)} of {a.size} elements of {name} never written: {_few(idx)}")
        for name, rows in self.multiple_writers.items():
            shown = "; ".join(f"{_fmt(i)} by {', '.join(_fmt_who(w) for w in who[:4])}"
                              + (" ..." if len(who) > 4 else "") for i, who in rows[:3])
            problems.append(f"{len(rows)} element{'s' * (len(rows) != 1)} of {name} written by several threads "
                            f"(a race): {shown}" + (" ..." if len(rows) > 3 else ""))
        hazards = self.shared_hazards
        if hazards:
            h = hazards[0]
            problems.append(f"{len(hazards)} shared slot{'s' * (len(hazards) != 1)} written by one thread and read by "
                            f"another between the same two barriers (a missing cuda.syncthreads()): {h['array']}"
                            f"{_fmt(h['index'])} written by {_fmt_who(h['writer'])}, read by {_fmt_who(h['reader'])}")
        return problems

    def _launch_summary(self, problems: bool = True) -> List[str]:
        (L,) = self.launches
        rec = self.records
        head = f"{L}: {L.n_blocks} block{'s' * (L.n_blocks != 1)} x {L.threads_per_block} threads"
        if L.n_blocks * L.threads_per_block == 0:
            return [head + ": no thread ran (a launch of 0 blocks or 0 threads does nothing)"]
        parts = []
        outs = self.outputs
        per = self._elements_per_thread(L, rec)
        parts.append(_writes_phrase(per, outs))
        st = self.sectors_per_warp_load()
        if st.accesses:
            dt = _DTYPE_NAMES.get(str(st.dtype), f"{st.dtype.itemsize}-byte elements")
            full = st.full_warp_ideal
            ideal_text = (f"ideal for {dt}: {full:g} = {self.warp_size * st.dtype.itemsize} bytes / "
                          f"{SECTOR}-byte sectors")
            phrase = f"warp loads touch {st.mean:.1f} sectors on average ({ideal_text})"
            if st.uncoalesced():
                phrase += (f"; {st.waste():.1f}x the sectors their bytes need: lanes of a warp read addresses far "
                           f"apart (uncoalesced)")
            elif abs(st.ideal - full) > 0.05:
                phrase += (f"; {st.ideal:.1f} is the least these loads need (some warps are partly idle or "
                           f"lanes share an address)")
            parts.append(phrase)
        else:
            parts.append("no global loads")
        found = self._problems() if problems else []
        lines = [head + ": " + "; ".join(parts + found)]
        loads = self._load_matrix(L, rec)
        if loads.size and loads.max() > 0:
            lo, hi, active = int(loads.min()), int(loads.max()), int((loads > 0).sum())
            lines.append(f"global loads per thread: {lo}" + (f" to {hi} (mean {loads.mean():.1f})" if hi != lo else
                                                                 " each")
                         + (f"; {loads.size - active} of {loads.size} threads loaded nothing"
                            if 0 < active < loads.size else ""))
        if outs:
            shapes = ", ".join(f"{n} {self.arrays_by_name()[n].shape}" for n in outs)
            lines.append(f"outputs: {shapes}")
        for name, most in self.atomic_outputs.items():
            lines.append(f"{name}: updated with atomics, up to {most} threads per element")
        sh = self.shared_traffic
        if sh:
            loads_b = [d["loads"] for d in sh.values()]
            stores_b = [d["stores"] for d in sh.values()]
            warp = sum(d["warp_accesses"] for d in sh.values())
            bad = sum(d["conflicted"] for d in sh.values())
            worst = max(d["max_ways"] for d in sh.values())
            txt = (f"shared memory per block: {_span(loads_b)} loads, {_span(stores_b)} stores; " +
                   ("no bank conflicts" if not bad else
                    f"{bad} of {warp} warp accesses have bank conflicts (up to {worst}-way: {worst} passes)"))
            lines.append(txt)
        return lines

    def arrays_by_name(self) -> Dict[str, ArrayInfo]:
        return {a.name: a for a in self.arrays.values()}

    def __repr__(self):
        if not self.available:
            return f"KernelTrace(not traced: {self.message})"
        return (f"KernelTrace({len(self.launches)} launch{'es' * (len(self.launches) != 1)}, {len(self.records)} "
                f"accesses; .summary(), .plot())")

    # -- picture --------------------------------------------------------------------------------------------
    def plot(self, max_launches: int = 4):
        """Four panels per kernel launch: the output coloured by the block that wrote each element (numbered by
        thread for small arrays; white: never written, black: written by several threads, A: atomics), global loads per
        thread, shared-memory traffic per block, and the sectors-per-warp-load histogram. Returns the figure
        (None when nothing was traced)."""
        if not self.available or not self.launches:
            return None
        from ..viz.common import pyplot
        plt = pyplot()
        n = min(len(self.launches), max_launches)
        fig, axes = plt.subplots(n, 4, figsize=(17, 3.4 * n), squeeze=False,
                                 gridspec_kw={"width_ratios": [1.5, 1.3, 0.9, 0.9]})
        for i, L in enumerate(self.launches[:n]):
            self.launch(L.index)._plot_row(axes[i], plt, alone=len(self.launches) == 1)
        if len(self.launches) > n:
            fig.suptitle(f"first {n} of {len(self.launches)} kernel launches", fontsize=10)
        fig.tight_layout()
        return fig

    def _plot_row(self, axes, plt, alone=True):
        import matplotlib.ticker as ticker
        (L,) = self.launches
        ax_out, ax_reads, ax_sh, ax_sec = axes
        cmap = plt.get_cmap("tab10")
        # 1. the output, coloured by the writing block
        writes = self._writes()
        mine = {name: e for name, e in writes.items() if any(Lw.index == L.index for Lw, _ in e["launches"])}
        if mine:
            name = max(mine, key=lambda k: len(next(per for Lw, per in mine[k]["launches"] if Lw.index == L.index)))
            a = mine[name]["array"]
            per = next(per for Lw, per in mine[name]["launches"] if Lw.index == L.index)
            rows, cols = _as_2d(a)
            img = np.ones((rows * cols, 4))
            labels = [""] * (rows * cols)
            for f in range(min(a.size, rows * cols)):
                if f not in per:
                    continue
                who, atomic = per[f]
                if len(who) > 1 and not atomic:
                    img[f] = (0.1, 0.1, 0.1, 1.0)           # black: a race
                    labels[f] = "!"
                else:
                    b, t = min(who)
                    img[f] = cmap(b % 10)
                    labels[f] = "A" if atomic and len(who) > 1 else str(t)
            ax_out.imshow(img.reshape(rows, cols, 4), aspect="auto", interpolation="nearest")
            width = max(len(x) for x in labels) if any(labels) else 1
            fs = min(7.0, 300 / cols / (0.75 * width), 150 / rows * 0.8)   # fit the number inside its cell
            if fs >= 3.5:
                for f, text in enumerate(labels):
                    if text:
                        ax_out.text(f % cols, f // cols, text, ha="center", va="center", fontsize=fs,
                                    color="white" if text == "!" else "black", in_layout=False)
            n_un = int(a.size - sum(1 for f in per if 0 <= f < a.size))
            others = [k for k in mine if k != name]
            thread = "thread" if L.block[1:] == (1, 1) else f"thread (y * {L.block[0]} + x)"
            ax_out.set_title(f"{L.kernel} wrote {name} {a.shape}\ncolour = block, number = {thread}" +
                             (f"; {n_un} not written{'' if alone else ' by this launch'} (white)" if n_un else "") +
                             ("; black !: several threads" if "!" in labels else "") +
                             (f"; also wrote {', '.join(others)}" if others else ""), fontsize=8)
            ax_out.set_xlabel("column" if len(a.shape) >= 2 else f"element % {cols}", fontsize=8)
            ax_out.set_ylabel("row" if len(a.shape) >= 2 else f"element // {cols}", fontsize=8)
            ax_out.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
            ax_out.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
            if rows == 1:
                ax_out.set_yticks([])
        else:
            ax_out.axis("off")
            ax_out.text(0.5, 0.5, f"{L.kernel}: no global stores", ha="center", va="center")
        # 2. global loads per thread
        loads = self._load_matrix(L, self.records)
        if not loads.size:
            for ax in (ax_reads, ax_sh, ax_sec):
                ax.axis("off")
            ax_reads.text(0.5, 0.5, f"{L}: no thread ran", ha="center", va="center", fontsize=9)
            return
        tpb = L.threads_per_block
        for b in range(L.n_blocks):
            ax_reads.stairs(loads[b], np.arange(b * tpb, (b + 1) * tpb + 1) - 0.5, fill=True, color=cmap(b % 10))
        ax_reads.set_xlim(-0.5, loads.size - 0.5)
        ax_reads.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax_reads.set_xlabel(f"thread (block x {L.threads_per_block} + thread), colour = block", fontsize=8)
        ax_reads.set_ylabel("global loads", fontsize=8)
        ax_reads.set_title(f"{L}: global loads per thread (mean {loads.mean():.1f})", fontsize=8)
        # 3. shared memory per block
        sh = self.shared_traffic
        if sh:
            keys = list(sh)
            xs = np.arange(len(keys))
            ax_sh.bar(xs - 0.2, [sh[k]["loads"] for k in keys], 0.4, label="loads", color="tab:blue")
            ax_sh.bar(xs + 0.2, [sh[k]["stores"] for k in keys], 0.4, label="stores", color="tab:orange")
            ax_sh.set_xticks(xs, [str(k) for k in keys], fontsize=7)
            ax_sh.set_xlabel("block", fontsize=8)
            bad = sum(d["conflicted"] for d in sh.values())
            worst = max(d["max_ways"] for d in sh.values())
            ax_sh.set_title("shared memory per block\n" + ("no bank conflicts" if not bad else
                            f"{bad} warp accesses with bank conflicts (up to {worst}-way)"), fontsize=8)
            ax_sh.legend(fontsize=7)
        else:
            ax_sh.axis("off")
            ax_sh.text(0.5, 0.5, "no shared memory", ha="center", va="center", fontsize=9)
        # 4. sectors per warp load
        st = self.sectors_per_warp_load()
        if st.accesses:
            ks = sorted(st.histogram)
            ax_sec.bar(ks, [st.histogram[k] for k in ks], width=0.8, color="tab:green")
            ax_sec.axvline(st.full_warp_ideal, color="gray", ls="--", lw=1,
                           label=f"coalesced full warp: {st.full_warp_ideal:g}")
            ax_sec.set_xlabel("32-byte sectors per warp load", fontsize=8)
            ax_sec.set_ylabel("warp loads", fontsize=8)
            ax_sec.set_xlim(0, max(max(ks), st.full_warp_ideal) + 1)
            ax_sec.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
            ax_sec.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
            ax_sec.set_title(f"coalescing: {st.mean:.1f} sectors per warp load", fontsize=8)
            ax_sec.legend(fontsize=7, loc="best")
        else:
            ax_sec.axis("off")
            ax_sec.text(0.5, 0.5, "no global loads", ha="center", va="center", fontsize=9)


def _as_2d(a: ArrayInfo):
    if a.order and len(a.shape) >= 2:
        cols = a.shape[-1]
        return max(1, a.size // max(cols, 1)), max(cols, 1)
    n = a.size
    cols = n if n <= 64 else 32
    return max(1, math.ceil(n / cols)), max(cols, 1)


def _writes_phrase(per: np.ndarray, outs: List[str]) -> str:
    if not outs:
        return "no thread wrote to global memory"
    flat = per.reshape(-1)
    writing = flat[flat > 0]
    total = flat.size
    what = f" of {outs[0]}" if len(outs) == 1 else ""
    if len(writing) == total and writing.min() == writing.max():
        c = int(writing[0])
        return f"each thread wrote {c} element{'s' * (c != 1)}{what}"
    if writing.size and writing.min() == writing.max():
        c = int(writing[0])
        each = " each" if len(writing) > 1 else ""
        return (f"{len(writing)} of {total} threads wrote {c} element{'s' * (c != 1)}{what}{each}, "
                f"{total - len(writing)} wrote nothing")
    if not writing.size:
        return "no thread wrote to global memory"
    s = (f"threads wrote {int(writing.min())} to {int(writing.max())} elements{what} "
         f"({writing.mean():.1f} on average)")
    if len(writing) < total:
        s += f", {total - len(writing)} of {total} wrote nothing"
    return s


def _span(values):
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo} to {hi}"


def _fmt(i):
    return str(i) if not isinstance(i, tuple) else "(" + ", ".join(str(v) for v in i) + ")"


def _fmt_who(w):
    b, t = w
    return f"block {_fmt(b)} thread {_fmt(t)}"


def _few(idx, k=6):
    return ", ".join(_fmt(i) for i in idx[:k]) + (" ..." if len(idx) > k else "")


# ------------------------------------------------------------------------------------------------------------
# Recording
# ------------------------------------------------------------------------------------------------------------
_RECORD_DTYPE = np.dtype([("launch", np.int32), ("space", np.int8), ("kind", np.int8), ("block", np.int32),
                          ("thread", np.int32), ("k", np.int32), ("array", np.int32), ("addr", np.int64),
                          ("size", np.int16), ("barrier", np.int32), ("wbarrier", np.int32)])
# barrier: the cuda.syncthreads() the thread had passed; wbarrier: those and its cuda.syncwarp() (a barrier for the
# lanes of its warp only)


def _data_ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _extent(a: np.ndarray):
    """(lowest byte address, one past the highest) that a's elements occupy in this process."""
    ptr = _data_ptr(a)
    if a.size == 0:
        return ptr, ptr
    lo = hi = ptr
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + a.itemsize


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(getattr(a, "base", None), np.ndarray):
        a = a.base
    return a


def _offsets(a: np.ndarray, idx) -> Tuple[int, ...]:
    """Byte offsets, from a's first element, of the elements a[idx] names (one for a scalar index)."""
    tup = idx if isinstance(idx, tuple) else (idx,)
    if len(tup) == a.ndim:
        off = 0
        try:
            for i, n, s in zip(tup, a.shape, a.strides):
                i = operator.index(i)
                off += (i + n if i < 0 else i) * s
            return (off,)
        except TypeError:
            pass
    sub = np.ndarray.__getitem__(a, idx)
    if not isinstance(sub, np.ndarray) or not np.shares_memory(sub, a):
        return ()
    base = _data_ptr(sub) - _data_ptr(a)
    return tuple(base + sum(i * s for i, s in zip(ix, sub.strides)) for ix in np.ndindex(*sub.shape))


class _SharedArray(np.ndarray):
    """A shared-memory array of the simulator that reports its element accesses to the trace being recorded."""

    def __array_finalize__(self, obj):
        self._kt = getattr(obj, "_kt", None)        # (recorder, ArrayInfo, ptr of the allocation's first byte)
        self._kt_v = None

    def _kt_vstart(self):
        if self._kt_v is None:
            self._kt_v = self._kt[1].vbase + (_data_ptr(self) - self._kt[2])
        return self._kt_v

    def __getitem__(self, idx):
        res = super().__getitem__(idx)
        if _REC is not None and self._kt is not None and self._kt[0] is _REC and not isinstance(res, np.ndarray):
            _REC.shared_access(self, idx, READ)
        return res

    def __setitem__(self, idx, val):
        super().__setitem__(idx, val)
        if _REC is not None and self._kt is not None and self._kt[0] is _REC:
            _REC.shared_access(self, idx, WRITE)


class _Recorder:
    def __init__(self, warp_size):
        self.warp_size = warp_size
        self.records: List[tuple] = []
        self.launches: List[Launch] = []
        self.arrays: Dict[int, ArrayInfo] = {}
        self.lock = threading.Lock()
        self.launch: Optional[Launch] = None
        self.next_vaddr = 1 << 20                       # first global array at 1 MiB (any 256-aligned start)
        self.shared_next: Dict[int, int] = {}            # per FakeCUDAShared (one per launch): next free offset
        self.shared_by_ptr: Dict[Tuple[int, int], ArrayInfo] = {}

    # -- arrays ---------------------------------------------------------------------------------------------
    def register_global(self, a: np.ndarray, name: str, provisional: bool = False) -> Optional[ArrayInfo]:
        """The global ArrayInfo holding a's memory, created (named `name`) if none does."""
        if not isinstance(a, np.ndarray) or a.size == 0:
            return None
        lo, hi = _extent(a)
        with self.lock:
            names = {i.name for i in self.arrays.values()}
            for info in self.arrays.values():
                if info.space == "global" and info.ptr <= lo and hi <= info.ptr + info.nbytes:
                    if info.provisional and not provisional and name not in names:
                        info.name, info.provisional = name, False
                    return info
            if name in names:
                name = next(f"{name}#{j}" for j in range(2, 10_000) if f"{name}#{j}" not in names)
            root = _root(a)
            misalign = (lo - _data_ptr(root)) % ALIGN if lo >= _data_ptr(root) else 0
            vbase = -(-self.next_vaddr // ALIGN) * ALIGN + misalign
            self.next_vaddr = vbase + (hi - lo)
            order = "C" if a.flags.c_contiguous else "F" if a.flags.f_contiguous else ""
            info = ArrayInfo(len(self.arrays), name, "global", tuple(int(s) for s in a.shape), a.dtype,
                             vbase=vbase, ptr=lo, nbytes=hi - lo, order=order, provisional=provisional)
            self.arrays[info.id] = info
            return info

    def shared_array(self, owner, key, arr: np.ndarray, frame) -> np.ndarray:
        """Wrap a freshly handed-out shared array so that its accesses are recorded."""
        ptr = _data_ptr(arr)
        with self.lock:
            info = self.shared_by_ptr.get((id(owner), ptr))
            if info is None:
                start = self.shared_next.get(id(owner), 0)
                start = -(-start // 16) * 16
                self.shared_next[id(owner)] = start + arr.nbytes
                name = _assigned_name(frame) or f"shared{len(self.shared_by_ptr)}"
                names = {i.name for i in self.arrays.values() if i.space == "shared"}
                if name in names and key != "dynamic":
                    name = next(f"{name}#{j}" for j in range(2, 10_000) if f"{name}#{j}" not in names)
                info = ArrayInfo(len(self.arrays), name, "shared", tuple(int(s) for s in arr.shape), arr.dtype,
                                 vbase=start, ptr=ptr, nbytes=arr.nbytes)
                self.arrays[info.id] = info
                self.shared_by_ptr[(id(owner), ptr)] = info
        view = arr.view(_SharedArray)
        view._kt = (self, info, ptr)
        view._kt_v = None
        return view

    # -- accesses -------------------------------------------------------------------------------------------
    def _thread_state(self):
        t = simwarp.current_thread()
        st = getattr(t, "_kt_state", None)
        if st is None or st[0] is not self:
            L = self.launch
            if L is None or not hasattr(t, "blockIdx"):
                return None
            b = t.blockIdx
            block = b.x + L.grid[0] * (b.y + L.grid[1] * b.z)
            # state: recorder, launch, block, thread, counters[space][kind], atomic depth, barriers passed, and
            # warp barriers passed (syncthreads and syncwarp)
            st = [self, L.index, block, t.thread_id, [[0, 0, 0], [0, 0, 0]], 0, 0, 0]
            t._kt_state = st
        return st

    def _log(self, space, kind, info: ArrayInfo, vaddr: int, size: int, atomic_inner=False):
        st = self._thread_state()
        if st is None or (st[5] and not atomic_inner):
            return
        c = st[4][space]
        k = c[kind]
        c[kind] = k + 1
        self.records.append((st[1], space, kind, st[2], st[3], k, info.id, vaddr, size, st[6], st[7]))

    def barrier(self):
        """The calling simulated thread reached cuda.syncthreads(): its later accesses are in the next interval."""
        st = self._thread_state()
        if st is not None:
            st[6] += 1
            st[7] += 1

    def warp_barrier(self):
        """The calling simulated thread reached cuda.syncwarp(): a barrier for the lanes of its warp."""
        st = self._thread_state()
        if st is not None:
            st[7] += 1

    def global_access(self, wrapper, idx, kind, atomic_inner=False):
        d = wrapper.__dict__
        cached = d.get("_kt")
        if cached is None or cached[0] is not self:
            a = d["_item"]._ary
            info = self.register_global(a, f"array{len(self.arrays)}")
            if info is None:
                return
            cached = (self, info, info.vbase + (_data_ptr(a) - info.ptr), a)
            d["_kt"] = cached
        _, info, vstart, a = cached
        for off in _offsets(a, idx):
            self._log(GLOBAL, kind, info, vstart + off, a.itemsize, atomic_inner)

    def shared_access(self, arr: _SharedArray, idx, kind, atomic_inner=False):
        info = arr._kt[1]
        vstart = arr._kt_vstart()
        for off in _offsets(arr, idx):
            self._log(SHARED, kind, info, vstart + off, arr.itemsize, atomic_inner)

    def finish(self, available=True, message="", error=None, fn_name="") -> KernelTrace:
        recs = np.array(self.records, dtype=_RECORD_DTYPE) if self.records else np.zeros(0, _RECORD_DTYPE)
        return KernelTrace(recs, self.launches, self.arrays, available, message, error, self.warp_size, fn_name)


def _assigned_name(frame) -> Optional[str]:
    """The variable a `name = cuda.shared.array(...)` line assigns, read from the kernel's source line."""
    try:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    except Exception:
        return None
    m = re.match(r"\s*([A-Za-z_]\w*)\s*=\s*[\w.]*shared\.array", line or "")
    return m.group(1) if m else None


# ------------------------------------------------------------------------------------------------------------
# The hooks (installed only while `trace` runs, removed afterwards, even when the call raises)
# ------------------------------------------------------------------------------------------------------------
def _install_hooks(rec: _Recorder):
    from numba.core import types as nb_types
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    from numba.cuda.simulator.kernelapi import FakeCUDAAtomic, FakeCUDAModule, FakeCUDAShared
    from numba.np import numpy_support

    saved = []

    def patch(cls, name, new):
        saved.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, new)

    orig_get = FakeWithinKernelCUDAArray.__getitem__
    orig_sync = simwarp.SimThread.syncthreads

    def syncthreads(self):
        if _REC is rec:
            rec.barrier()
        return orig_sync(self)
    orig_set = FakeWithinKernelCUDAArray.__setitem__
    orig_call = FakeCUDAKernel.__call__

    def get_item(self, idx):
        res = orig_get(self, idx)
        if _REC is rec and not isinstance(res, FakeWithinKernelCUDAArray):
            rec.global_access(self, idx, READ)
        return res

    def set_item(self, idx, val):
        orig_set(self, idx, val)
        if _REC is rec:
            rec.global_access(self, idx, WRITE)

    def kernel_call(self, *args):
        if self._device or _REC is not rec:
            return orig_call(self, *args)
        try:
            names = list(inspect.signature(self.fn).parameters)
        except (TypeError, ValueError):
            names = []
        names += [f"arg{i}" for i in range(len(names), len(args))]
        new_args = []
        for name, a in zip(names, args):
            if isinstance(a, np.ndarray) and a.ndim > 0 and (a.flags.c_contiguous or a.flags.f_contiguous):
                # the simulator would copy it to a fake device array and back; handing it over in place gives
                # the same result and lets the trace name the array after your argument
                a = FakeCUDAArray(a)
            if isinstance(a, FakeCUDAArray):
                rec.register_global(a._ary, name)
            new_args.append(a)
        grid, block = self.grid_dim, self.block_dim
        L = Launch(len(rec.launches), getattr(self.fn, "__name__", "kernel"),
                   tuple(int(v) for v in grid) if grid else (1, 1, 1),
                   tuple(int(v) for v in block) if block else (1, 1, 1))
        rec.launches.append(L)
        rec.launch = L
        try:
            return orig_call(self, *new_args)
        finally:
            rec.launch = None

    def shared_array(self, shape, dtype):
        # Same allocation rule as the simulator's (one array per source line of the kernel, dynamic shared memory
        # for shape 0), re-stated here because the simulator identifies the line from its caller's frame.
        if isinstance(dtype, nb_types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        if shape == 0:
            count = self._dynshared_size // np.dtype(dtype).itemsize
            arr = np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
            key = "dynamic"
        else:
            key = (frame.f_code.co_filename, frame.f_lineno)
            arr = self._allocations.get(key)
            if arr is None:
                arr = np.empty(shape, dtype)
                self._allocations[key] = arr
        if _REC is not rec:
            return arr
        return rec.shared_array(self, key, arr, frame)

    def atomic(name, orig):
        def op(self, array, *rest):
            st = rec._thread_state() if _REC is rec else None
            if st is None:
                return orig(self, array, *rest)
            st[5] += 1
            try:
                res = orig(self, array, *rest)
            finally:
                st[5] -= 1
            index = (0,) * array.ndim if name == "compare_and_swap" else rest[0]
            if isinstance(array, FakeWithinKernelCUDAArray):
                rec.global_access(array, index, ATOMIC, atomic_inner=True)
            elif isinstance(array, _SharedArray) and array._kt is not None:
                rec.shared_access(array, index, ATOMIC, atomic_inner=True)
            return res
        op.__name__ = name
        return op

    try:
        patch(FakeWithinKernelCUDAArray, "__getitem__", get_item)
        patch(FakeWithinKernelCUDAArray, "__setitem__", set_item)
        patch(FakeCUDAKernel, "__call__", kernel_call)
        patch(FakeCUDAShared, "array", shared_array)
        patch(simwarp.SimThread, "syncthreads", syncthreads)
        if "syncwarp" in FakeCUDAModule.__dict__:  # the simulator's, or simwarp's
            orig_syncwarp = FakeCUDAModule.__dict__["syncwarp"]

            def syncwarp(self, *args, **kwargs):
                if _REC is rec:
                    rec.warp_barrier()
                return orig_syncwarp(self, *args, **kwargs)

            patch(FakeCUDAModule, "syncwarp", syncwarp)
        for name in _ATOMICS:
            if name in FakeCUDAAtomic.__dict__:
                patch(FakeCUDAAtomic, name, atomic(name, FakeCUDAAtomic.__dict__[name]))
    except BaseException:
        _remove_hooks(saved)
        raise
    return saved


def _remove_hooks(saved):
    for cls, name, orig in reversed(saved):
        setattr(cls, name, orig)
    saved.clear()


# ------------------------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------------------------
def trace(fn, *args, warp_size: int = 32, raise_errors: bool = False) -> KernelTrace:
    """Call fn(*args) once in Numba's CUDA simulator and record every memory access its kernels make.

    fn: your launcher (a function that launches Numba kernels) or a configured kernel (`kernel[blocks, threads]`).
    args: as you would pass them (NumPy arrays, simulator device arrays, scalars); outputs are written as usual.
    Keep them tiny: a few blocks of 32 threads. warp_size: lanes grouped into one warp access (32 on NVIDIA).
    raise_errors: re-raise an exception from fn (default: keep it in `.error` and report it in `.summary()`).

    Returns a KernelTrace (`.summary()`, `.plot()`, `.writer`, `.reads_per_thread`, `.shared_traffic`,
    `.sectors_per_warp_load()`). On a real GPU nothing runs and the trace says that tracing is simulator-only.
    """
    global _REC
    if not callable(fn):
        raise TypeError(f"trace(fn, *args): fn must be your launcher or kernel, got {type(fn).__name__} {fn!r:.60}")
    warp_size = int(warp_size)
    if warp_size < 1:
        raise ValueError(f"trace: warp_size={warp_size} must be positive")
    name = getattr(fn, "__name__", None) or type(fn).__name__
    from .. import device
    if device.numba_on_gpu():
        return KernelTrace(np.zeros(0, _RECORD_DTYPE), [], {}, available=False, message=SIM_ONLY, fn_name=name)
    import numba
    if not numba.config.ENABLE_CUDASIM:
        return KernelTrace(np.zeros(0, _RECORD_DTYPE), [], {}, available=False, fn_name=name,
                           message="kernel tracing needs Numba's CUDA simulator, which is off in this session "
                                   "(NUMBA_ENABLE_CUDASIM=0): nothing was traced")
    if _REC is not None:
        raise RuntimeError("trace: another trace is being recorded (traces do not nest)")
    rec = _Recorder(warp_size)
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    for i, a in enumerate(args):                       # name arrays after your arguments first
        arr = a if isinstance(a, np.ndarray) else getattr(a, "_ary", None)
        if isinstance(arr, np.ndarray) and arr.ndim > 0:
            if i < len(params):
                rec.register_global(arr, params[i])
            else:                                      # fn(*args): the kernel's parameter names will do
                rec.register_global(arr, f"arg{i}", provisional=True)
    saved = _install_hooks(rec)
    _REC = rec
    error = None
    try:
        fn(*args)
    except Exception as e:  # the learner's code failed: keep what ran before it
        error = e
    finally:
        _REC = None
        _remove_hooks(saved)
    if error is not None and raise_errors:
        raise error
    # arrays named but never touched are left out of the picture
    touched = set(np.unique(np.array([r[6] for r in rec.records], dtype=np.int64)).tolist()) if rec.records else set()
    rec.arrays = {i: a for i, a in rec.arrays.items() if i in touched}
    return rec.finish(error=error, fn_name=name)


# ------------------------------------------------------------------------------------------------------------
# The arguments a checker passes (so a task's own signature and a small case come for free)
# ------------------------------------------------------------------------------------------------------------
class _Captured(Exception):
    """Raised by the stand-in function once it has the checker's arguments: it stops the check."""


def args_like(check, fn, case: int = 0, **check_kw) -> tuple:
    """The arguments the course checker `check` passes to your function on its case number `case` (0: the first;
    simulator sizes): `check` is called with a stand-in for fn that keeps the arguments and stops the check there
    (nothing is printed or recorded for grading). For case > 0 the earlier cases run your function, so the check
    goes on; if it stops sooner (a wrong answer), the last arguments it passed are returned. check_kw go to the
    checker (default arrays="numba", size="small", seed=0 where it takes them).
    Example: trace(row_max, *args_like(check_row_max, row_max))."""
    if not callable(check):
        raise TypeError(f"args_like: check must be a checker such as check_row_max, got {type(check).__name__}")
    case = int(case)
    if case < 0:
        raise ValueError(f"args_like: case={case} must be 0 or more")
    captured = []

    @functools.wraps(fn)
    def stand_in(*args, **kwargs):
        captured.append(args)
        if len(captured) > case:
            raise _Captured("arguments captured")
        return fn(*args, **kwargs)

    try:
        params = inspect.signature(check).parameters
    except (TypeError, ValueError):
        params = {}
    kw = {k: v for k, v in (("quiet", True), ("arrays", "numba"), ("size", "small"), ("seed", 0)) if k in params}
    kw.update(check_kw)
    from ..classroom import grading
    record = grading.record
    grading.record = lambda *a, **k: None          # this is not an attempt: keep it out of the grade log
    try:
        check(stand_in, **kw)
    except _Captured:
        pass
    except Exception as e:
        if not captured:
            raise RuntimeError(f"args_like: {getattr(check, '__name__', check)} raised {type(e).__name__}: {e} "
                               f"before calling the function") from e
    finally:
        grading.record = record
    if not captured:
        raise RuntimeError(f"args_like: {getattr(check, '__name__', check)} never called the function, so there are "
                           f"no arguments to trace with; pass the arrays yourself")
    return captured[-1]


# ------------------------------------------------------------------------------------------------------------
# Tiny inputs for the course's ops (destination-passing: inputs, then zeroed outputs, then ints)
# ------------------------------------------------------------------------------------------------------------
EXAMPLE_DIMS = {
    # sizes that span more than one block of 32 threads (or 16 x 16 tile) with a partial last one, and stay fast
    "linear_backward": dict(N=5, C=20, OC=18),
    "softmax_backward": dict(N=3, n=40),
    "layernorm_backward": dict(N=3, C=40),
    "gelu_backward": dict(n=70),
    "crossentropy_backward": dict(N=3, V=40),
    "attention_backward": dict(B=1, T=5, C=8, n_head=2),
    "encoder_backward": dict(B=2, T=5, C=8, V=7, maxT=6),
    "residual_backward": dict(n=70),
}


def example_args(op: str, seed: int = 0, **dims) -> tuple:
    """Tiny float32 arguments for one of the course's ops, in its launcher's order (see CONTRIBUTING.md):

        linear_backward(dout (N,OC), inp (N,C), weight (C,OC), dinp, dweight, dbias)
        softmax_backward(dout (N,n), out (N,n), dinp)
        layernorm_backward(dout (N,C), inp (N,C), weight (C,), mean (N,), rstd (N,), dinp, dweight, dbias)
        gelu_backward(dout (n,), inp (n,), dinp)
        crossentropy_backward(logits (N,V), targets (N,) int32, dlogits)
        attention_backward(dout (B,T,C), qkv (B,T,3C), att (B,nh,T,T), dqkv, n_head)
        encoder_backward(dout (B,T,C), idx (B,T) int32, dwte (V,C), dwpe (maxT,C))
        residual_backward(dout (n,), da, db)

    Outputs are zero-filled. dims override the sizes in EXAMPLE_DIMS[op] (e.g. N=64, n=8)."""
    if op not in EXAMPLE_DIMS:
        raise ValueError(f"example_args: op={op!r} is not one of {', '.join(EXAMPLE_DIMS)}")
    unknown = set(dims) - set(EXAMPLE_DIMS[op])
    if unknown:
        raise ValueError(f"example_args({op!r}): unknown size {', '.join(sorted(unknown))}; "
                         f"sizes: {', '.join(EXAMPLE_DIMS[op])}")
    d = dict(EXAMPLE_DIMS[op], **dims)
    rng = np.random.default_rng(seed)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def zeros(*shape):
        return np.zeros(shape, np.float32)

    if op == "linear_backward":
        N, C, OC = d["N"], d["C"], d["OC"]
        return f32(N, OC), f32(N, C), f32(C, OC), zeros(N, C), zeros(C, OC), zeros(OC)
    if op == "softmax_backward":
        N, n = d["N"], d["n"]
        logits = f32(N, n)
        e = np.exp(logits - logits.max(1, keepdims=True))
        return f32(N, n), (e / e.sum(1, keepdims=True)).astype(np.float32), zeros(N, n)
    if op == "layernorm_backward":
        N, C = d["N"], d["C"]
        inp = f32(N, C)
        mean = inp.mean(1)
        rstd = (1.0 / np.sqrt(inp.var(1) + 1e-5)).astype(np.float32)
        return f32(N, C), inp, f32(C), mean.astype(np.float32), rstd, zeros(N, C), zeros(C), zeros(C)
    if op in ("gelu_backward",):
        n = d["n"]
        return f32(n), f32(n), zeros(n)
    if op == "residual_backward":
        n = d["n"]
        return f32(n), zeros(n), zeros(n)
    if op == "crossentropy_backward":
        N, V = d["N"], d["V"]
        return f32(N, V), rng.integers(0, V, N).astype(np.int32), zeros(N, V)
    if op == "attention_backward":
        B, T, C, nh = d["B"], d["T"], d["C"], d["n_head"]
        scores = np.where(np.tril(np.ones((T, T), bool)), rng.standard_normal((B, nh, T, T)), -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att = (att / att.sum(-1, keepdims=True)).astype(np.float32)
        return f32(B, T, C), f32(B, T, 3 * C), att, zeros(B, T, 3 * C), int(nh)
    B, T, C, V, maxT = d["B"], d["T"], d["C"], d["V"], d["maxT"]     # encoder_backward
    return f32(B, T, C), rng.integers(0, V, (B, T)).astype(np.int32), zeros(V, C), zeros(maxT, C)
