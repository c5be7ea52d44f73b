"""Communicators: collectives on flat buffers between ranks (one process per GPU, or per CPU rank).

    comm = comm.from_env()                    # SingleComm, MPIComm or NCCLComm, from the environment
    comm.all_reduce(grads.flat)               # in place, sum over ranks
    comm.reduce_scatter(send, recv)           # send (W*n,) -> recv (n,): rank r gets the sum of every rank's chunk r
    comm.all_gather(send, recv)               # send (n,)   -> recv (W*n,): chunk r is rank r's send
    comm.broadcast(buf, root=0); comm.send(buf, peer); comm.recv(buf, peer); comm.sendrecv(s, dst, r, src)
    req = comm.all_reduce_async(buf); ...; req.wait()   # started now, finished by wait(): buf untouched meanwhile
    comm.barrier()

One interface, three engines, none of them written here (no sockets of our own):
    SingleComm  world size 1: every collective is a no-op or a copy, so single-process code runs the same path.
    MPIComm     mpi4py (MPI.COMM_WORLD) on NumPy buffers: data parallel and ZeRO run and are tested on CPU ranks.
                CuPy buffers are staged through host memory (a copy to the host, the MPI call, a copy back): correct
                on any MPI, slow; CUDA-aware MPI is not assumed. On GPUs use NCCLComm.
    NCCLComm    NCCL through cupy.cuda.nccl on CuPy buffers of this rank's GPU, on CuPy's current stream. send/recv
                pairs are grouped (ncclGroupStart/End) so a sendrecv never deadlocks.

Buffers: contiguous arrays (any shape: their elements are used in memory order); every rank passes the same
size and dtype (collectives cannot check the other ranks' buffers: a mismatch hangs or corrupts, so call them in
the same order with the same sizes everywhere). Errors raised here name the problem: a dtype the engine cannot
reduce, a non-contiguous buffer, sizes that do not divide by the world size, a NumPy buffer given to NCCL.

from_env(): the launcher (python -m gpullm_lessons.parallel.launch) sets RANK, WORLD_SIZE, LOCAL_RANK (and GPULLM_COMM,
GPULLM_NCCL_ID for NCCL); mpirun sets OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK (PMI_RANK / PMI_SIZE for MPICH);
SLURM's srun sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID in each task of a job step (read last, and only inside
a step: an sbatch script itself also sees SLURM_NTASKS, but it is one process). World size 1 gives a SingleComm;
otherwise NCCL when this process has a GPU and NCCL, MPI when not (GPULLM_COMM=mpi|nccl or backend= forces one).
NCCL's unique id (128 bytes) is made once: by the launcher, passed in GPULLM_NCCL_ID as hex; under mpirun or srun
rank 0 makes it and broadcasts it with MPI.

Ranks started by srun (no mpirun) find each other through SLURM's PMI, the same rendezvous mpirun's ranks use:
`srun --mpi=pmix` serves PMIx to every task, so MPI_Init (mpi4py's import) joins the step's tasks into one
MPI.COMM_WORLD, on one node or several, and the NCCL id then travels over that MPI like under mpirun. Checked on
Debian 12: its slurm-wlm (22.05) offers pmix (pmix_v4), pmi2, cray_shasta and none (`srun --mpi=list`); its Open MPI
(4.1) is built against PMIx 4 and has no PMI-2 client, so with it only --mpi=pmix works (--mpi=pmi2 or none abort
inside MPI_Init); an MPICH-based mpi4py uses --mpi=pmi2. A rendezvous without MPI (a TCP store, a file on a shared
disk) was the other option: it would carry the NCCL id, but the CPU ranks would still need MPI for their
collectives, and a second rendezvous is a second thing to debug; PMIx is in every SLURM that labs run and needs no
port or shared folder of ours. A step of several tasks without a PMI (srun --mpi=none, the default where slurm.conf
has no MpiDefault) is refused before MPI_Init with the fix (srun --mpi=pmix, or MpiDefault=pmix in slurm.conf).
"""

from __future__ import annotations

import os
import time

import numpy as np

OPS = ("sum", "prod", "max", "min")
NCCL_ID_ENV = "GPULLM_NCCL_ID"  # the NCCL unique id, 128 bytes as 256 hex digits
COMM_ENV = "GPULLM_COMM"  # mpi | nccl: which engine the ranks use (set by the launcher)
REDUCE_DTYPES = ("float32", "float64", "int32", "int64")  # every engine reduces these
NCCL_REDUCE_DTYPES = REDUCE_DTYPES + ("float16", "uint8")


class CommError(RuntimeError):
    """A communicator that cannot be made or a call that cannot work; the message names the problem and the fix."""


# ---- the environment ---------------------------------------------------------------------------------------------


def env_world() -> tuple:
    """(rank, world_size, local_rank) from the launcher's, mpirun's or srun's variables; (0, 1, 0) when none is set."""
    e = os.environ
    triples = [
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ]
    if under_srun():
        triples.append(("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    for rk, sz, lr in triples:
        if sz in e:
            try:
                size, rank = int(e[sz]), int(e.get(rk, "0"))
                local = int(e.get(lr, e.get("LOCAL_RANK", rank)))
            except ValueError as exc:
                raise CommError(
                    f"{rk}={e.get(rk)!r} / {sz}={e.get(sz)!r} / {lr}={e.get(lr)!r}: expected integers"
                ) from exc
            if not (size >= 1 and 0 <= rank < size):
                raise CommError(f"{rk}={rank} is not in 0..{sz}-1={size - 1}")
            if not 0 <= local < size:
                raise CommError(
                    f"{lr}={local} is not in 0..{sz}-1={size - 1} (a local rank numbers the ranks of one node)"
                )
            return rank, size, local
    return 0, 1, 0


def under_mpirun() -> bool:
    """True when this process was started by mpirun / mpiexec (Open MPI or an MPICH-like PMI)."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


SLURM_SPECIAL_STEPS = 0xFFFFFFF0  # step ids from here up are SLURM's batch, extern and interactive steps


def under_srun() -> bool:
    """True in a task of a SLURM job step (srun): SLURM_STEP_ID is set and names an ordinary step. An sbatch script
    (the batch step) or an salloc shell sees SLURM_NTASKS too, but is one process, not a rank."""
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
    if step is None or "SLURM_PROCID" not in os.environ:
        return False
    try:
        return int(step) < SLURM_SPECIAL_STEPS
    except ValueError:
        return False


def srun_pmi():
    """The PMI srun gave this task: "pmix" (srun --mpi=pmix), "pmi2" (--mpi=pmi2), or None (--mpi=none)."""
    if "PMIX_RANK" in os.environ or "PMIX_NAMESPACE" in os.environ:
        return "pmix"
    if "PMI_SIZE" in os.environ or "PMI_FD" in os.environ:
        return "pmi2"
    return None


def mpi_rendezvous():
    """How this process's MPI_Init finds the other ranks: "mpirun", "srun --mpi=pmix" / "srun --mpi=pmi2", or None.

    A SLURM step of several tasks without a PMI raises CommError with the fix: there MPI_Init would abort in every
    task (Open MPI) or give each task a world of its own."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return "mpirun"
    if under_srun():
        pmi, tasks = srun_pmi(), os.environ.get("SLURM_NTASKS", "1")
        if pmi is None and tasks != "1":
            raise CommError(
                f"srun started {tasks} tasks (SLURM_NTASKS={tasks}) without a PMI (srun --mpi=none, the "
                f"default of a slurm.conf without MpiDefault), so their MPI cannot find each other: "
                f"start them with srun --mpi=pmix (srun --mpi=list shows what this cluster offers; an "
                f"MPICH-based mpi4py takes --mpi=pmi2), or ask the admin for MpiDefault=pmix in slurm.conf"
            )
        return None if pmi is None else f"srun --mpi={pmi}"
    if "PMI_SIZE" in os.environ:
        return "mpirun"
    return None


def nccl_module():
    """cupy.cuda.nccl when CuPy and an NCCL library are both usable, else None.

    CuPy wheels look for libnccl in their own library folder; PyTorch's wheels install NCCL as the pip package
    nvidia-nccl-cu12 / -cu13. When CuPy finds none, that copy is loaded (RTLD_GLOBAL) and CuPy's binding retried."""
    try:
        import cupy.cuda.nccl as nccl
    except Exception:
        return None
    if getattr(nccl, "available", False):
        return nccl
    try:
        import ctypes
        import glob
        import importlib
        import site
        import sys

        roots = list(dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()] + sys.path))
        for root in roots:
            for lib in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libnccl.so*"), recursive=True)):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                nccl = importlib.reload(nccl)
                if getattr(nccl, "available", False):
                    return nccl
    except Exception:
        pass
    return None


def nccl_id_hex(nccl=None) -> str:
    """A fresh NCCL unique id as hex (made in this process: NCCL's bootstrap root listens here until the ranks join)."""
    nccl = nccl or nccl_module()
    if nccl is None:
        raise CommError(
            "NCCL is not available: CuPy is missing or found no NCCL library (pip install "
            "nvidia-nccl-cu13, or cu12, beside cupy-cuda13x / cupy-cuda12x)"
        )
    return bytes(int(b) & 0xFF for b in nccl.get_unique_id()).hex()


def _nccl_id_from_hex(text: str) -> tuple:
    raw = bytes.fromhex(text.strip())
    if len(raw) != 128:
        raise CommError(f"{NCCL_ID_ENV} holds {len(raw)} bytes, an NCCL unique id has 128")
    return tuple(b - 256 if b > 127 else b for b in raw)  # C char is signed on the platforms NCCL runs on


# ---- buffers -----------------------------------------------------------------------------------------------------


def is_cupy(a) -> bool:
    return (type(a).__module__ or "").startswith("cupy")


def _flat(fn, name, a):
    """A contiguous buffer as a 1-D view (no copy); errors name the argument."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{fn}: {name} must be a NumPy or CuPy array, got {type(a).__name__}")
    flags = getattr(a, "flags", None)
    if flags is not None and not flags.c_contiguous:
        raise ValueError(
            f"{fn}: {name} must be contiguous (a flat buffer or a contiguous slice of one), got "
            f"strides {a.strides}; pass np.ascontiguousarray(...) or the flat buffer"
        )
    return a.reshape(-1)


def _check_op(fn, op):
    if op not in OPS:
        raise ValueError(f"{fn}: op must be one of {', '.join(OPS)}, got {op!r}")


def _check_reduce_dtype(fn, a, allowed):
    if str(a.dtype) not in allowed:
        raise TypeError(
            f"{fn}: cannot reduce dtype {a.dtype} with this communicator (it reduces "
            f"{', '.join(allowed)}); bf16 bits (uint16) cannot be summed as integers: reduce the fp32 "
            f"buffer instead"
        )


def _check_split(fn, big, small, world, big_name, small_name):
    if big.size != world * small.size:
        raise ValueError(
            f"{fn}: {big_name} has {big.size} elements and {small_name} {small.size}; {big_name} must "
            f"hold world_size x {small_name} = {world} x {small.size} = {world * small.size} (pad the "
            f"flat buffer to a multiple of the world size, see parallel.shard_size)"
        )
    if big.dtype != small.dtype:
        raise TypeError(f"{fn}: {big_name} is {big.dtype} and {small_name} {small.dtype}: they must match")


# ---- the interface -----------------------------------------------------------------------------------------------


class Request:
    """A collective started by a *_async call and not yet waited for. Until wait() returns, its buffer belongs to the
    communication: do not read it or write it.

    wait(): block until the result is in the buffer (for a GPU buffer: and make the current stream wait for it);
    calling it again does nothing. test(): True once the collective has completed (on MPI each call also lets the
    library progress it, which Open MPI does only inside MPI calls). started / finished: time.perf_counter() when it
    was started and when it was first seen complete (None until then). seconds(): how long it ran: the GPU's own
    clock on NCCL (events around it on the communication stream), else finished - started as seen from the host."""

    def __init__(self, what, test=None, wait=None, after=None, timer=None):
        self.what, self.started, self.finished = what, time.perf_counter(), None
        self._test, self._wait, self._after, self._timer = test, wait, after, timer
        if test is None:  # done already (a blocking call underneath)
            self._complete()

    def _complete(self):
        if self._after is not None:
            self._after()
        self.finished = time.perf_counter()

    def test(self) -> bool:
        if self.finished is None and self._test():
            self._complete()
        return self.finished is not None

    def wait(self) -> "Request":
        if self.finished is None:
            self._wait()
            self._complete()
        return self

    def seconds(self) -> float:
        if self.finished is None:
            raise RuntimeError(f"{self.what}: seconds() of a request that has not completed; wait() first")
        return self._timer() if self._timer is not None else self.finished - self.started

    def __repr__(self):
        return f"Request({self.what}, {'done' if self.finished is not None else 'in flight'})"


class Communicator:
    """Collectives among world_size ranks on flat contiguous buffers (see the module docstring)."""

    name = "?"

    def __init__(self, rank=0, world_size=1, local_rank=0):
        self.rank, self.world_size, self.local_rank = int(rank), int(world_size), int(local_rank)

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # collectives (in place where one buffer is given)
    def all_reduce(self, buf, op="sum"):
        raise NotImplementedError

    def reduce_scatter(self, send, recv, op="sum"):
        raise NotImplementedError

    def all_gather(self, send, recv):
        raise NotImplementedError

    def broadcast(self, buf, root=0):
        raise NotImplementedError

    def all_reduce_async(self, buf, op="sum") -> Request:
        """Start all_reduce(buf, op) and return a Request at once (data parallel overlaps it with the backward pass).
        Every rank must start its non-blocking collectives in the same order. Here (SingleComm, and any engine
        without a non-blocking call): the all-reduce runs now and the request is already complete."""
        self.all_reduce(buf, op)
        return Request("all_reduce")

    # point to point
    def send(self, buf, peer):
        raise NotImplementedError

    def recv(self, buf, peer):
        raise NotImplementedError

    def sendrecv(self, send_buf, dst, recv_buf, src):
        """Send send_buf to rank dst and receive recv_buf from rank src at the same time (never deadlocks)."""
        raise NotImplementedError

    def all_to_all(self, send, recv):
        """Chunk j of send (world_size equal chunks) goes to rank j; chunk i of recv comes from rank i. Built from
        sendrecv for every engine: the own chunk copied, then N-1 steps, at step k sending to rank + k and
        receiving from rank - k (each step a pair of ranks exchanging: no deadlock)."""
        s, r = _flat("all_to_all", "send", send), _flat("all_to_all", "recv", recv)
        N, me = self.world_size, self.rank
        if s.size != r.size or s.size % N:
            raise ValueError(
                f"all_to_all: send has {s.size} elements and recv {r.size}; both must hold world_size = {N} equal "
                f"chunks"
            )
        if s.dtype != r.dtype:
            raise TypeError(f"all_to_all: send is {s.dtype} and recv {r.dtype}: they must match")
        n = s.size // N
        r[me * n : (me + 1) * n] = s[me * n : (me + 1) * n]
        for k in range(1, N):
            dst, src = (me + k) % N, (me - k) % N
            self.sendrecv(s[dst * n : (dst + 1) * n], dst, r[src * n : (src + 1) * n], src)
        return recv

    def barrier(self):
        raise NotImplementedError

    def synchronize(self):
        """Wait until this rank's communication is finished (NCCL: the stream; MPI calls return when done)."""

    def close(self):
        pass

    # helpers built on the collectives
    def _peer(self, fn, peer):
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.world_size:
            raise ValueError(f"{fn}: peer must be a rank in 0..{self.world_size - 1}, got {peer!r}")
        return int(peer)

    def _host_like(self, values):
        """A small float64 array on this communicator's device (NumPy here; NCCL overrides)."""
        return np.array(values, dtype=np.float64)

    def array_module(self):
        """The array module of this communicator's buffers: numpy, or cupy for one that moves GPU memory (NCCL)."""
        if is_cupy(self._host_like([0.0])):
            import cupy

            return cupy
        return np

    def all_reduce_scalars(self, values, op="sum") -> np.ndarray:
        """Reduce a few Python numbers over ranks (one small all-reduce); returns a NumPy float64 array."""
        a = self._host_like(list(values))
        self.all_reduce(a, op)
        return np.asarray(a.get() if is_cupy(a) else a, dtype=np.float64)

    def gather_scalars(self, values) -> np.ndarray:
        """Every rank's few numbers, on every rank: (world_size, len(values)) float64 (one all-gather)."""
        a = self._host_like(list(values))
        out = self._host_like([0.0] * (a.size * self.world_size))
        self.all_gather(a, out)
        return np.asarray(out.get() if is_cupy(out) else out, dtype=np.float64).reshape(self.world_size, -1)


class SingleComm(Communicator):
    """World size 1: collectives are no-ops or copies, so code written for N ranks runs unchanged on one."""

    name = "single"

    def __init__(self):
        super().__init__(0, 1, 0)

    def all_reduce(self, buf, op="sum"):
        _check_op("all_reduce", op)
        _flat("all_reduce", "buf", buf)
        return buf

    def reduce_scatter(self, send, recv, op="sum"):
        _check_op("reduce_scatter", op)
        s, r = _flat("reduce_scatter", "send", send), _flat("reduce_scatter", "recv", recv)
        _check_split("reduce_scatter", s, r, 1, "send", "recv")
        r[...] = s
        return recv

    def all_gather(self, send, recv):
        s, r = _flat("all_gather", "send", send), _flat("all_gather", "recv", recv)
        _check_split("all_gather", r, s, 1, "recv", "send")
        r[...] = s
        return recv

    def broadcast(self, buf, root=0):
        self._peer("broadcast", root)
        return buf

    def send(self, buf, peer):
        raise CommError("send: a world of one rank has no peer to send to (a SingleComm); sendrecv to rank 0 copies")

    recv = send

    def sendrecv(self, send_buf, dst, recv_buf, src):
        self._peer("sendrecv", dst)
        self._peer("sendrecv", src)
        s, r = _flat("sendrecv", "send_buf", send_buf), _flat("sendrecv", "recv_buf", recv_buf)
        if s.size != r.size:
            raise ValueError(
                f"sendrecv: send_buf has {s.size} elements and recv_buf {r.size}; with one rank it "
                f"receives what it sends"
            )
        r[...] = s
        return recv_buf

    def barrier(self):
        pass


class MPIComm(Communicator):
    """MPI (mpi4py, MPI.COMM_WORLD) on NumPy buffers; CuPy buffers are staged through the host (module docstring)."""

    name = "mpi"

    def __init__(self, mpi_comm=None):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise CommError(
                "MPIComm needs mpi4py: pip install mpi4py (or the course's extra: pip install -e "
                "'.[mpi]'), and an MPI library (apt-get install openmpi-bin libopenmpi-dev)"
            ) from exc
        self.MPI = MPI
        self.comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        rank, world, local = env_world()  # mpirun's or srun's local rank, when it describes this MPI
        if (rank, world) != (self.comm.Get_rank(), self.comm.Get_size()):
            local = self.comm.Get_rank()
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), local)
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}

    def _msg(self, a):
        """A NumPy array as an MPI message; dtypes MPI has no type for (float16, bf16 bits) move as bytes."""
        if str(a.dtype) in REDUCE_DTYPES or str(a.dtype) in ("uint8", "int8", "uint32", "uint64", "int16"):
            return a
        return [a.view(np.uint8), self.MPI.BYTE]

    def _stage(self, fn, *bufs):
        """Host arrays for the call: NumPy as they are (1-D views), CuPy copied to the host."""
        return [(b.get() if is_cupy(b) else b).reshape(-1) if b is not None else None for b in bufs]

    @staticmethod
    def _unstage(dev, host):
        if is_cupy(dev):
            dev.reshape(-1).set(host)

    def all_reduce(self, buf, op="sum"):
        _check_op("all_reduce", op)
        b = _flat("all_reduce", "buf", buf)
        _check_reduce_dtype("all_reduce", b, REDUCE_DTYPES)
        (h,) = self._stage("all_reduce", b)
        self.comm.Allreduce(self.MPI.IN_PLACE, h, op=self._ops[op])
        self._unstage(b, h)
        return buf

    def all_reduce_async(self, buf, op="sum"):
        """MPI_Iallreduce in place; a CuPy buffer is copied to the host now and back when the request completes."""
        _check_op("all_reduce_async", op)
        b = _flat("all_reduce_async", "buf", buf)
        _check_reduce_dtype("all_reduce_async", b, REDUCE_DTYPES)
        (h,) = self._stage("all_reduce_async", b)
        req = self.comm.Iallreduce(self.MPI.IN_PLACE, h, op=self._ops[op])
        return Request("all_reduce", test=req.Test, wait=req.Wait, after=lambda: self._unstage(b, h))

    def reduce_scatter(self, send, recv, op="sum"):
        _check_op("reduce_scatter", op)
        s, r = _flat("reduce_scatter", "send", send), _flat("reduce_scatter", "recv", recv)
        _check_split("reduce_scatter", s, r, self.world_size, "send", "recv")
        _check_reduce_dtype("reduce_scatter", s, REDUCE_DTYPES)
        hs, hr = self._stage("reduce_scatter", s, r)
        self.comm.Reduce_scatter_block(hs, hr, op=self._ops[op])
        self._unstage(r, hr)
        return recv

    def all_gather(self, send, recv):
        s, r = _flat("all_gather", "send", send), _flat("all_gather", "recv", recv)
        _check_split("all_gather", r, s, self.world_size, "recv", "send")
        hs, hr = self._stage("all_gather", s, r)
        if np.shares_memory(hs, hr):  # send is this rank's slice of recv (ZeRO's parameter gather)
            hs = hs.copy()
        self.comm.Allgather(self._msg(hs), self._msg(hr))
        self._unstage(r, hr)
        return recv

    def broadcast(self, buf, root=0):
        root = self._peer("broadcast", root)
        b = _flat("broadcast", "buf", buf)
        (h,) = self._stage("broadcast", b)
        self.comm.Bcast(self._msg(h), root=root)
        self._unstage(b, h)
        return buf

    def send(self, buf, peer):
        peer = self._peer("send", peer)
        (h,) = self._stage("send", _flat("send", "buf", buf))
        self.comm.Send(self._msg(h), dest=peer)

    def recv(self, buf, peer):
        peer = self._peer("recv", peer)
        b = _flat("recv", "buf", buf)
        (h,) = self._stage("recv", b)
        self.comm.Recv(self._msg(h), source=peer)
        self._unstage(b, h)
        return buf

    def sendrecv(self, send_buf, dst, recv_buf, src):
        dst, src = self._peer("sendrecv", dst), self._peer("sendrecv", src)
        s, r = _flat("sendrecv", "send_buf", send_buf), _flat("sendrecv", "recv_buf", recv_buf)
        hs, hr = self._stage("sendrecv", s, r)
        self.comm.Sendrecv(self._msg(hs), dest=dst, recvbuf=self._msg(hr), source=src)
        self._unstage(r, hr)
        return recv_buf

    def barrier(self):
        self.comm.Barrier()

    def bcast_object(self, obj, root=0):
        return self.comm.bcast(obj, root=root)


class NCCLComm(Communicator):
    """NCCL (cupy.cuda.nccl) on CuPy buffers of this rank's GPU, on CuPy's current stream."""

    name = "nccl"

    def __init__(self, rank, world_size, nccl_id, local_rank=None, device=None):
        nccl = nccl_module()
        if nccl is None:
            raise CommError(
                "NCCLComm needs CuPy with an NCCL library: pip install cupy-cuda13x (or 12x) and "
                "nvidia-nccl-cu13 (or cu12); or run the ranks on MPI (--backend mpi)"
            )
        import cupy as cp

        local_rank = rank if local_rank is None else int(local_rank)
        n_dev = cp.cuda.runtime.getDeviceCount()
        dev = local_rank if device is None else int(device)
        if dev >= n_dev:
            raise CommError(
                f"rank {rank}: local rank {local_rank} needs GPU {dev}, and this node has {n_dev}: start "
                f"at most {n_dev} ranks per node"
            )
        cp.cuda.Device(dev).use()
        self.cp, self.nccl, self.device = cp, nccl, dev
        super().__init__(rank, world_size, local_rank)
        uid = _nccl_id_from_hex(nccl_id) if isinstance(nccl_id, str) else tuple(nccl_id)
        try:  # CuPy 14 takes the id as bytes; older CuPy as a tuple of signed chars
            self.comm = nccl.NcclCommunicator(world_size, bytes(b & 0xFF for b in uid), rank)
        except TypeError:
            self.comm = nccl.NcclCommunicator(world_size, uid, rank)
        g = lambda name, default: getattr(nccl, name, default)  # noqa: E731
        self._ops = {
            "sum": g("NCCL_SUM", 0),
            "prod": g("NCCL_PROD", 1),
            "max": g("NCCL_MAX", 2),
            "min": g("NCCL_MIN", 3),
        }
        self._types = {
            "int8": g("NCCL_INT8", 0),
            "uint8": g("NCCL_UINT8", 1),
            "int32": g("NCCL_INT32", 2),
            "uint32": g("NCCL_UINT32", 3),
            "int64": g("NCCL_INT64", 4),
            "uint64": g("NCCL_UINT64", 5),
            "float16": g("NCCL_FLOAT16", 6),
            "float32": g("NCCL_FLOAT32", 7),
            "float64": g("NCCL_FLOAT64", 8),
        }

    def _dev(self, fn, name, a):
        if not is_cupy(a):
            raise TypeError(
                f"{fn}: {name} is a {type(a).__module__}.{type(a).__name__}; NCCL moves GPU memory: pass "
                f"a CuPy array (cupy.asarray(...)) on this rank's GPU {self.device}"
            )
        if a.device.id != self.device:
            raise ValueError(
                f"{fn}: {name} lives on GPU {a.device.id}, this rank's communicator on GPU "
                f"{self.device}: allocate it under cupy.cuda.Device({self.device})"
            )
        return _flat(fn, name, a)

    def _type(self, a):
        """(NCCL datatype, count): dtypes NCCL does not know move as bytes (not for reductions)."""
        dt = str(a.dtype)
        if dt in self._types:
            return self._types[dt], a.size
        return self._types["uint8"], a.nbytes

    @property
    def _stream(self):
        return self.cp.cuda.get_current_stream().ptr

    def all_reduce(self, buf, op="sum"):
        _check_op("all_reduce", op)
        b = self._dev("all_reduce", "buf", buf)
        _check_reduce_dtype("all_reduce", b, NCCL_REDUCE_DTYPES)
        t, n = self._type(b)
        if n:
            self.comm.allReduce(b.data.ptr, b.data.ptr, n, t, self._ops[op], self._stream)
        return buf

    def all_reduce_async(self, buf, op="sum"):
        """The all-reduce on a second stream of this GPU, so that the kernels queued next on the current stream (the
        rest of the backward pass) run beside it. An event recorded on the current stream now (everything queued so
        far, the writes of buf included) is what the communication stream waits for; an event recorded after the
        all-reduce is what wait() waits for, on the host and on the current stream, before buf is read again."""
        _check_op("all_reduce_async", op)
        b = self._dev("all_reduce_async", "buf", buf)
        _check_reduce_dtype("all_reduce_async", b, NCCL_REDUCE_DTYPES)
        cp = self.cp
        if getattr(self, "_comm_stream", None) is None:
            self._comm_stream = cp.cuda.Stream(non_blocking=True)
        side, ready = self._comm_stream, cp.cuda.Event(disable_timing=True)
        ready.record(cp.cuda.get_current_stream())
        side.wait_event(ready)
        start, done = cp.cuda.Event(), cp.cuda.Event()
        start.record(side)
        t, n = self._type(b)
        if n:
            self.comm.allReduce(b.data.ptr, b.data.ptr, n, t, self._ops[op], side.ptr)
        done.record(side)
        return Request(
            "all_reduce",
            test=lambda: done.done,
            wait=done.synchronize,
            after=lambda: cp.cuda.get_current_stream().wait_event(done),
            timer=lambda: cp.cuda.get_elapsed_time(start, done) / 1e3,
        )

    def reduce_scatter(self, send, recv, op="sum"):
        _check_op("reduce_scatter", op)
        s, r = self._dev("reduce_scatter", "send", send), self._dev("reduce_scatter", "recv", recv)
        _check_split("reduce_scatter", s, r, self.world_size, "send", "recv")
        _check_reduce_dtype("reduce_scatter", s, NCCL_REDUCE_DTYPES)
        t, n = self._type(r)
        self.comm.reduceScatter(s.data.ptr, r.data.ptr, n, t, self._ops[op], self._stream)
        return recv

    def all_gather(self, send, recv):
        s, r = self._dev("all_gather", "send", send), self._dev("all_gather", "recv", recv)
        _check_split("all_gather", r, s, self.world_size, "recv", "send")
        t, n = self._type(s)
        self.comm.allGather(s.data.ptr, r.data.ptr, n, t, self._stream)
        return recv

    def broadcast(self, buf, root=0):
        root = self._peer("broadcast", root)
        b = self._dev("broadcast", "buf", buf)
        t, n = self._type(b)
        self.comm.broadcast(b.data.ptr, b.data.ptr, n, t, root, self._stream)
        return buf

    def send(self, buf, peer):
        peer = self._peer("send", peer)
        b = self._dev("send", "buf", buf)
        t, n = self._type(b)
        self.comm.send(b.data.ptr, n, t, peer, self._stream)

    def recv(self, buf, peer):
        peer = self._peer("recv", peer)
        b = self._dev("recv", "buf", buf)
        t, n = self._type(b)
        self.comm.recv(b.data.ptr, n, t, peer, self._stream)
        return buf

    def sendrecv(self, send_buf, dst, recv_buf, src):
        dst, src = self._peer("sendrecv", dst), self._peer("sendrecv", src)
        s, r = self._dev("sendrecv", "send_buf", send_buf), self._dev("sendrecv", "recv_buf", recv_buf)
        (ts, ns), (tr, nr) = self._type(s), self._type(r)
        self.nccl.groupStart()  # both or neither: the pair cannot deadlock
        try:  # an empty message is skipped on both sides (same chunk, same size)
            if ns:
                self.comm.send(s.data.ptr, ns, ts, dst, self._stream)
            if nr:
                self.comm.recv(r.data.ptr, nr, tr, src, self._stream)
        finally:
            self.nccl.groupEnd()
        return recv_buf

    def barrier(self):
        one = self.cp.ones(1, self.cp.float32)
        self.all_reduce(one)
        self.synchronize()

    def synchronize(self):
        self.cp.cuda.get_current_stream().synchronize()

    def _host_like(self, values):
        return self.cp.asarray(np.array(values, dtype=np.float64))

    def close(self):
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            comm.destroy()


# ---- choosing one ------------------------------------------------------------------------------------------------


def _has_gpu() -> bool:
    from .. import device

    return device.has_gpu() and device.kind() in ("cuda", "rocm")


def from_env(backend=None) -> Communicator:
    """The communicator this process should use (module docstring): SingleComm for one rank, else NCCL or MPI.

    backend: None / "auto" (GPULLM_COMM if set; else NCCL on a GPU with NCCL, MPI otherwise), "mpi" or "nccl"."""
    rank, world, local = env_world()
    backend = backend or os.environ.get(COMM_ENV) or "auto"
    if backend not in ("auto", "mpi", "nccl", "single"):
        raise CommError(f"communicator backend must be auto, mpi or nccl, got {backend!r}")
    if world == 1 or backend == "single":
        if world > 1:
            raise CommError(f"backend 'single' with WORLD_SIZE={world}")
        return SingleComm()
    if backend == "auto":
        backend = "nccl" if _has_gpu() and nccl_module() is not None else "mpi"
    if backend == "mpi":
        if mpi_rendezvous() is None:
            raise CommError(
                f"WORLD_SIZE={world} but this process was not started by mpirun: MPI ranks are started "
                f"with mpirun -n {world} ..., srun --mpi=pmix -n {world} ... or python -m "
                f"gpullm_lessons.parallel.launch --backend mpi"
            )
        _use_gpu(rank, local, required=False)  # CPU ranks may outnumber the GPUs
        comm = MPIComm()
        if comm.world_size != world:
            raise CommError(f"MPI has {comm.world_size} ranks but the environment says WORLD_SIZE={world}")
        return comm
    # nccl
    uid = os.environ.get(NCCL_ID_ENV)
    if uid is None and mpi_rendezvous() is None:
        raise CommError(
            f"NCCL ranks need the NCCL unique id in ${NCCL_ID_ENV}: start them with python -m "
            f"gpullm_lessons.parallel.launch --nproc {world} (it makes the id), or with mpirun or srun --mpi=pmix "
            f"(rank 0 makes it and broadcasts it over MPI)"
        )
    _use_gpu(rank, local)
    if uid is None:
        mpi = MPIComm()
        uid = mpi.bcast_object(nccl_id_hex() if mpi.rank == 0 else None, root=0)
    return NCCLComm(rank, world, uid, local_rank=local)


def _use_gpu(rank, local, required=True):
    """On a GPU machine: make GPU `local` this process's device (CuPy, and Numba when it runs on the GPU)."""
    if not _has_gpu():
        return
    import cupy as cp

    n_dev = cp.cuda.runtime.getDeviceCount()
    if local >= n_dev and not required:
        return
    if local >= n_dev:
        slurm = (
            " (SLURM: --gpus-per-task / --gpu-bind show each task only its own GPU; ask for --gpus-per-node=N "
            "with --ntasks-per-node=N instead)"
            if under_srun()
            else ""
        )
        raise CommError(
            f"rank {rank}: local rank {local} but this node has {n_dev} GPU(s): start at most {n_dev} "
            f"ranks per node (--nproc, or mpirun -n / a hostfile's slots){slurm}"
        )
    cp.cuda.Device(local).use()
    try:
        from .. import device

        if device.numba_on_gpu():
            from numba import cuda

            cuda.select_device(local)
    except Exception:
        pass
