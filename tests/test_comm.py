"""The communicators (parallel/comm.py) and the launcher (parallel/launch.py): semantics and errors in one process, every collective
on 2 and 3 MPI ranks (CI: Open MPI on the CPU), and on 2 GPUs with NCCL (gpu-marked)."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from gpullm_lessons.parallel import comm as C
from gpullm_lessons.parallel import launch as L

from conftest import require_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_mpi():
    """mpirun and mpi4py, or skip (fail with GPULLM_REQUIRE_COMPILERS=1, as on CI)."""
    require_tool("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        if os.environ.get("GPULLM_REQUIRE_COMPILERS") == "1":
            pytest.fail("GPULLM_REQUIRE_COMPILERS=1 but mpi4py is not installed (pip install -e '.[dev]')")
        pytest.skip("mpi4py not installed (pip install mpi4py)")


def run_mpi(n, module, args, timeout=120, cwd=ROOT):
    """mpirun -n n python -m module args, with the root / oversubscribe settings the launcher uses."""
    require_mpi()
    cmd = L.mpirun_command(n, list(args), module=module)
    env = L.mpi_env()
    env["GPULLM_COMM"] = "mpi"                     # CPU ranks, even on a machine with GPUs
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


# ---- one process ---------------------------------------------------------------------------------------------------

def test_single_comm_is_the_identity():
    c = C.SingleComm()
    a = np.arange(6, dtype=np.float32)
    assert c.all_reduce(a) is a and np.array_equal(a, np.arange(6))
    out = np.zeros(6, np.float32)
    c.reduce_scatter(a, out)
    assert np.array_equal(out, a)
    out[...] = 0
    c.all_gather(a, out)
    assert np.array_equal(out, a)
    r = np.zeros(6, np.float32)
    c.sendrecv(a, 0, r, 0)
    assert np.array_equal(r, a)
    c.broadcast(a, 0)
    c.barrier()
    assert c.all_reduce_scalars([2.5])[0] == 2.5
    assert c.gather_scalars([1.0, 2.0]).shape == (1, 2)
    with pytest.raises(C.CommError, match="no peer"):
        c.send(a, 0)


def test_errors_name_the_problem():
    c = C.SingleComm()
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="contiguous"):
        c.all_reduce(a[:, ::2])
    with pytest.raises(ValueError, match="op must be one of"):
        c.all_reduce(a, op="mean")
    with pytest.raises(ValueError, match="world_size x recv"):
        c.reduce_scatter(np.zeros(5, np.float32), np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="must match"):
        c.all_gather(np.zeros(3, np.float32), np.zeros(3, np.float64))
    with pytest.raises(ValueError, match="peer must be a rank"):
        c.broadcast(a, root=1)
    with pytest.raises(TypeError, match="NumPy or CuPy array"):
        c.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="cannot reduce dtype uint16"):
        C._check_reduce_dtype("all_reduce", np.zeros(2, np.uint16), C.REDUCE_DTYPES)


def test_nccl_rejects_host_buffers():
    nc = C.NCCLComm.__new__(C.NCCLComm)          # no GPU here: only the argument check
    nc.device = 0
    with pytest.raises(TypeError, match="NCCL moves GPU memory: pass a CuPy array"):
        nc._dev("all_reduce", "buf", np.zeros(3, np.float32))


def test_nccl_id_round_trip():
    raw = bytes(range(128))[::-1]
    uid = C._nccl_id_from_hex(raw.hex())
    assert len(uid) == 128 and min(uid) >= -128 and max(uid) <= 127
    assert bytes(b & 0xFF for b in uid) == raw
    with pytest.raises(C.CommError, match="128"):
        C._nccl_id_from_hex("00ff")


def test_env_world_and_from_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE",
                "PMI_RANK", C.COMM_ENV, C.NCCL_ID_ENV):
        monkeypatch.delenv(var, raising=False)
    assert C.env_world() == (0, 1, 0)
    assert isinstance(C.from_env(), C.SingleComm)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert C.env_world() == (3, 4, 1)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(C.CommError, match="not in 0"):
        C.env_world()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(C.CommError, match="not started by mpirun"):
        C.from_env("mpi")
    with pytest.raises(C.CommError, match="unique id"):
        C.from_env("nccl")
    with pytest.raises(C.CommError, match="must be auto, mpi or nccl"):
        C.from_env("gloo")


# ---- the launcher --------------------------------------------------------------------------------------------------

def test_mpirun_command_and_env(monkeypatch):
    monkeypatch.setattr(L.shutil, "which", lambda name: "/usr/bin/" + name)
    cmd = L.mpirun_command(2, ["selftest"], module="gpullm_lessons.parallel")
    assert cmd[:3] == ["/usr/bin/mpirun", "-n", "2"] and cmd[-3:] == ["-m", "gpullm_lessons.parallel", "selftest"]
    many = L.mpirun_command((os.cpu_count() or 1) + 1, [])
    assert "--oversubscribe" in many
    env = L.mpi_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert "RANK" not in env and "WORLD_SIZE" not in env and env["OPENBLAS_NUM_THREADS"] == "1"
    if os.geteuid() == 0:
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"


def test_launcher_errors(monkeypatch, capsys):
    monkeypatch.setattr(L.shutil, "which", lambda name: None)
    with pytest.raises(L.LaunchError, match="apt-get install openmpi-bin"):
        L.mpirun_command(2, [])
    monkeypatch.setattr(L, "_has_mpi4py", lambda: False)
    with pytest.raises(L.LaunchError, match="pip install mpi4py"):
        L.choose_backend("mpi", 2)
    monkeypatch.setattr(L, "gpu_count", lambda: 1)
    monkeypatch.setattr(C, "nccl_module", lambda: object())
    with pytest.raises(L.LaunchError, match="--nproc 2 is larger than the 1 GPU"):
        L.choose_backend("nccl", 2)
    monkeypatch.setattr(L, "gpu_count", lambda: 0)
    with pytest.raises(L.LaunchError, match="needs GPUs"):
        L.choose_backend("nccl", 1)
    assert L.main(["--nproc", "0", "--", "x"]) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err


def test_run_ranks_stops_the_others_on_failure():
    py = sys.executable
    t0 = time.time()
    status = L.run_ranks([[py, "-c", "import time; time.sleep(60)"], [py, "-c", "import sys; sys.exit(3)"]],
                         [dict(os.environ)] * 2, grace_s=5)
    assert status == 3 and time.time() - t0 < 30
    assert L.run_ranks([[py, "-c", "pass"]] * 2, [dict(os.environ)] * 2) == 0


# ---- real ranks ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3])
def test_collectives_on_mpi_ranks(n):
    p = run_mpi(n, "gpullm_lessons.parallel", ["selftest"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[FAIL]" not in p.stdout and f"passed on {n} ranks (mpi)" in p.stdout, p.stdout
    assert "a ring without its all-gather phase is caught" in p.stdout


def test_launcher_runs_mpi_ranks():
    require_mpi()
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "gpullm_lessons.parallel.launch", "--nproc", "2", "--backend", "mpi", "--module",
                        "gpullm_lessons.parallel", "--", "selftest"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "passed on 2 ranks (mpi)" in p.stdout


@pytest.mark.gpu
def test_nccl_collectives_on_two_gpus():
    if gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpus()}")
    if C.nccl_module() is None:
        pytest.fail("CuPy found no NCCL library: pip install nvidia-nccl-cu13 (or cu12)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "gpullm_lessons.parallel.launch", "--nproc", "2", "--backend", "nccl",
                        "--module", "gpullm_lessons.parallel", "--", "selftest"], env=env, capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "[FAIL]" not in p.stdout and "passed on 2 ranks (nccl)" in p.stdout, p.stdout


def test_mpi_extra_is_in_dev():
    import tomllib

    extras = tomllib.loads(open(os.path.join(ROOT, "pyproject.toml")).read())["project"]["optional-dependencies"]
    assert any(r.startswith("mpi4py") for r in extras["mpi"])
    assert any(r.startswith("mpi4py") for r in extras["dev"])


# ---- NCCLComm's own logic, on a stand-in for CuPy + NCCL (ranks as threads, buffers in host memory) --------------
# What it checks: NCCLComm passes the right pointers, counts, datatypes, roots and peers, groups its sendrecv, and
# selftest / the ring / the benchmark run on it. What it cannot check: the real library (the gpu-marked tests do).

import ctypes  # noqa: E402 - the stand-in section's own imports
import threading  # noqa: E402 - the stand-in section's own imports
import types  # noqa: E402 - the stand-in section's own imports

_DT = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16, 7: np.float32,
       8: np.float64}
_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}
_local = threading.local()


def _view(ptr, count, dtype):
    dt = np.dtype(_DT[dtype])
    if count == 0:
        return np.zeros(0, dt)
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dtype=dt)


class FakeArray(np.ndarray):
    """A host array dressed as a CuPy one: .data.ptr, .device.id, .get(); its type's module starts with 'cupy'."""

    def __array_finalize__(self, obj):
        self._dev = getattr(obj, "_dev", getattr(_local, "device", 0))

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):
        return types.SimpleNamespace(id=self._dev)

    def get(self):
        return np.array(self, copy=True).view(np.ndarray)


FakeArray.__module__ = "cupy._fake"


def _wrap(a):
    out = np.ascontiguousarray(a).view(FakeArray)
    out._dev = getattr(_local, "device", 0)
    return out


class _World:
    def __init__(self, n):
        self.n, self.barrier, self.slots, self.mail = n, threading.Barrier(n, timeout=30), [None] * n, {}


_WORLDS = {}


class FakeNccl:
    """The cupy.cuda.nccl API surface NCCLComm uses, for ranks that are threads of one process."""
    available = True
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

    @staticmethod
    def get_unique_id():
        return tuple(int(b) - 256 if b > 127 else int(b) for b in np.random.default_rng().integers(0, 256, 128))

    @staticmethod
    def groupStart():
        _local.group = []

    @staticmethod
    def groupEnd():
        ops, _local.group = _local.group, None
        _local.comm._p2p(ops)

    class NcclCommunicator:
        def __init__(self, ndev, uid, rank):
            assert len(uid) == 128 and isinstance(uid, bytes)   # CuPy 14: the id as bytes (older: signed-char tuple)
            self.world = _WORLDS.setdefault(uid, _World(ndev))
            self.rank = rank
            _local.comm = self

        def _collective(self, mine, compute):
            w = self.world
            w.slots[self.rank] = mine
            w.barrier.wait()
            result = compute(w.slots)
            w.barrier.wait()
            return result

        def allReduce(self, send, recv, count, dtype, op, stream):
            self.streams = getattr(self, "streams", []) + [stream]   # which stream each all-reduce was queued on
            res = self._collective(_view(send, count, dtype).copy(), lambda s: _OPS[op].reduce(np.stack(s)))
            _view(recv, count, dtype)[...] = res
            self.world.barrier.wait()

        def reduceScatter(self, send, recv, count, dtype, op, stream):
            n = self.world.n
            full = self._collective(_view(send, n * count, dtype).copy(), lambda s: _OPS[op].reduce(np.stack(s)))
            _view(recv, count, dtype)[...] = full[self.rank * count:(self.rank + 1) * count]
            self.world.barrier.wait()

        def allGather(self, send, recv, count, dtype, stream):
            res = self._collective(_view(send, count, dtype).copy(), lambda s: np.concatenate(s))
            _view(recv, self.world.n * count, dtype)[...] = res
            self.world.barrier.wait()

        def broadcast(self, send, recv, count, dtype, root, stream):
            res = self._collective(_view(send, count, dtype).copy(), lambda s: s[root].copy())
            _view(recv, count, dtype)[...] = res
            self.world.barrier.wait()

        def send(self, buf, count, dtype, peer, stream):
            assert _local.group is not None, "send outside a group would block in this fake"
            _local.group.append(("send", _view(buf, count, dtype).copy(), peer))

        def recv(self, buf, count, dtype, peer, stream):
            assert _local.group is not None, "recv outside a group would block in this fake"
            _local.group.append(("recv", (buf, count, dtype), peer))

        def _p2p(self, ops):
            w = self.world
            for kind, data, peer in ops:
                if kind == "send":
                    w.mail[(self.rank, peer)] = data
            w.barrier.wait()
            for kind, (buf, count, dtype), peer in [o for o in ops if o[0] == "recv"]:
                got = w.mail[(peer, self.rank)]
                assert got.size == count and got.dtype == _DT[dtype], (got.size, count)
                _view(buf, count, dtype)[...] = got
            w.barrier.wait()

        def destroy(self):
            pass


def _fake_cupy(n_gpus):
    cp = types.ModuleType("cupy")
    cp.float32, cp.float64, cp.uint16, cp.int32 = np.float32, np.float64, np.uint16, np.int32
    cp.asarray = lambda a, dtype=None: _wrap(np.asarray(a, dtype=dtype))
    cp.zeros = lambda n, dtype=np.float64: _wrap(np.zeros(n, dtype))
    cp.empty = lambda n, dtype=np.float64: _wrap(np.empty(n, dtype))
    cp.ones = lambda n, dtype=np.float64: _wrap(np.ones(n, dtype))
    class Event:  # the fake's work runs at once: an event is done once recorded
        def __init__(self, disable_timing=False):
            self.on = None

        def record(self, stream=None):
            self.on = stream

        def synchronize(self):
            assert self.on is not None, "waiting for an event never recorded"

        done = property(lambda self: self.on is not None)

    class Stream:
        def __init__(self, non_blocking=False):
            self.ptr, self.waited = id(self), []

        def wait_event(self, event):
            assert event.on is not None, "a stream waits for an event never recorded"
            self.waited.append(event)

        def synchronize(self):
            pass

    stream = Stream()
    stream.ptr = 0  # the current (main) stream

    class Device:
        def __init__(self, i=None):
            self.id = getattr(_local, "device", 0) if i is None else i

        def use(self):
            _local.device = self.id

    cp.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: n_gpus), Device=Device,
                                    get_current_stream=lambda: stream, nccl=FakeNccl, Stream=Stream, Event=Event,
                                    get_elapsed_time=lambda start, end: 0.0)
    return cp


@pytest.mark.parametrize("N", [2, 3])
def test_nccl_comm_logic_on_a_fake_nccl(monkeypatch, N, capsys):
    from gpullm_lessons import parallel

    cp = _fake_cupy(N)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", FakeNccl)
    uid = bytes(int(b) & 0xFF for b in FakeNccl.get_unique_id()).hex()
    results, errors = [None] * N, []

    def rank(r):
        try:
            c = C.NCCLComm(r, N, uid, local_rank=r)
            assert c.device == r and _local.device == r
            ok = parallel.selftest(c)
            # all_reduce_async: on a second stream that first waits for the current one, which waits for it in turn
            side, main = c._comm_stream, cp.cuda.get_current_stream()
            assert side.ptr != main.ptr and side.ptr in c.comm.streams and main.ptr in c.comm.streams
            assert side.waited and all(e.on is main for e in side.waited)
            assert any(e.on is side for e in main.waited)
            rows = parallel.bench_allreduce(c, sizes=[1024, 4100], iters=2)
            bad = None
            try:
                c.all_reduce(np.zeros(3, np.float32))
            except TypeError as e:
                bad = str(e)
            results[r] = (ok, rows, bad)
        except Exception:  # pragma: no cover - reported below
            import traceback
            errors.append(f"rank {r}: {traceback.format_exc()}")
            for w in _WORLDS.values():
                w.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "\n".join(errors)
    out = capsys.readouterr().out
    assert all(res[0] for res in results), out
    assert f"passed on {N} ranks (nccl)" in out and "[FAIL]" not in out
    rows = results[0][1]
    assert {r["algo"] for r in rows} == {"nccl", "ring"}
    assert all("CuPy array" in res[2] for res in results)
