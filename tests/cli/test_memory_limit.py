"""--max-memory: its parsing and its default from fake cgroup files, Slurm variables and
/proc/meminfo (cli/memory_limit.py), and on a GPU from a fake cupy's memGetInfo: serially,
and under MPI (`-m mpi`, any rank count) the GPU's share per rank on the node."""
import pytest

from mpishard.cli import memory_limit
from mpishard.cli.memory_limit import (default_max_memory, gpu_max_memory, job_memory,
                                       max_memory, node_ranks, parse_bytes)

GIB = 2 ** 30


@pytest.mark.parametrize("text,want", [("12G", 12 * GIB), ("512M", 512 * 2 ** 20),
                                       ("1.5g", int(1.5 * GIB)), ("64KiB", 65536),
                                       ("2TB", 2 * 2 ** 40), ("1000", 1000), (" 3 G ", 3 * GIB)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["", "G", "12X", "-1G", "0", "12 GB extra", "1e9"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="expected a positive number of bytes"):
        parse_bytes(text)


def fake(tmp_path, v2=None, v1=None, total_kb=None):
    """A fake cgroup root and meminfo file under tmp_path."""
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    if v2 is not None:
        (root / "memory.max").write_text(v2 + "\n")
    if v1 is not None:
        (root / "memory" / "memory.limit_in_bytes").write_text(v1 + "\n")
    meminfo = tmp_path / "meminfo"
    if total_kb is not None:
        meminfo.write_text(f"MemTotal:       {total_kb} kB\nMemFree:        1 kB\n")
    return str(root), str(meminfo)


def test_sources_in_order(tmp_path):
    root, meminfo = fake(tmp_path, v2=str(8 * GIB), v1=str(4 * GIB), total_kb=64 * 2 ** 20)
    env = {"SLURM_MEM_PER_NODE": "1024"}
    assert job_memory(env, root, meminfo)[:2] == (8 * GIB, f"cgroup {root}/memory.max")
    root, meminfo = fake(tmp_path / "a", v2="max", v1=str(4 * GIB), total_kb=64 * 2 ** 20)
    assert job_memory(env, root, meminfo)[0] == 4 * GIB               # v2 unlimited: v1
    root, meminfo = fake(tmp_path / "b", v1=str(2 ** 63 - 4096), total_kb=64 * 2 ** 20)
    assert job_memory(env, root, meminfo) == (GIB, "SLURM_MEM_PER_NODE", False)
    per_cpu = {"SLURM_MEM_PER_CPU": "2048", "SLURM_CPUS_PER_TASK": "3"}
    assert job_memory(per_cpu, root, meminfo)[::2] == (6 * GIB, True)
    assert job_memory({}, root, meminfo) == (64 * GIB, "MemTotal of /proc/meminfo", False)
    assert job_memory({}, root, str(tmp_path / "none"))[0] is None


def test_own_cgroup_first(tmp_path):
    root, meminfo = fake(tmp_path, v2=str(8 * GIB), total_kb=64 * 2 ** 20)
    (tmp_path / "cgroup" / "job" / "step").mkdir(parents=True)
    (tmp_path / "cgroup" / "job" / "step" / "memory.max").write_text(f"{3 * GIB}\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/job/step\n")
    assert job_memory({}, root, meminfo, str(proc))[:2] == \
        (3 * GIB, f"cgroup {root}/job/step/memory.max")
    (tmp_path / "cgroup" / "job" / "step" / "memory.max").write_text("max\n")
    assert job_memory({}, root, meminfo, str(proc))[0] == 8 * GIB     # unlimited: the root's
    root, meminfo = fake(tmp_path / "v1", v1=str(2 ** 63 - 4096), total_kb=64 * 2 ** 20)
    (tmp_path / "v1" / "cgroup" / "memory" / "slurm" / "job_7").mkdir(parents=True)
    (tmp_path / "v1" / "cgroup" / "memory" / "slurm" / "job_7" / "memory.limit_in_bytes"
     ).write_text(f"{5 * GIB}\n")
    proc.write_text("9:name=systemd:/\n4:memory:/slurm/job_7\n3:cpuset:/\n0::/\n")
    assert job_memory({}, root, meminfo, str(proc))[0] == 5 * GIB


def test_default_divides_by_the_ranks_on_the_node(tmp_path):
    root, meminfo = fake(tmp_path, v2=str(8 * GIB), total_kb=64 * 2 ** 20)
    limit, source = default_max_memory(None, {"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, root, meminfo)
    assert limit == 2 * GIB and "/ 4 rank(s) on the node" in source
    per_cpu = {"SLURM_MEM_PER_CPU": "1024", "MPI_LOCALNRANKS": "8"}     # per rank already
    assert default_max_memory(None, per_cpu, root + "x", meminfo)[0] == GIB
    assert node_ranks(None, {"SLURM_NTASKS_PER_NODE": "6"}) == 6 and node_ranks(None, {}) == 1
    with pytest.raises(ValueError, match="give --max-memory"):
        default_max_memory(None, {}, root + "x", str(tmp_path / "none"))


class FakeCupy:
    """cupy's calls gpu_max_memory makes: `count` GPUs, GPU i with free[i] bytes free and bus
    id bus[i]; getDeviceCount raises where `broken`."""

    def __init__(self, free, bus=None, broken=False):
        fake, self.free, self.bus, self.current = self, list(free), bus, 0

        class Device:
            def __init__(self, index):
                self.index = index
                if fake.bus is not None:
                    self.pci_bus_id = fake.bus[index]

            def __enter__(self):
                self.before, fake.current = fake.current, self.index
                return self

            def __exit__(self, *exc):
                fake.current = self.before

        class Runtime:
            @staticmethod
            def getDeviceCount():
                if broken:
                    raise RuntimeError("cudaErrorInsufficientDriver")
                return len(fake.free)

            @staticmethod
            def memGetInfo():
                return fake.free[fake.current], 80 * GIB

        self.cuda = type("cuda", (), {"Device": Device, "runtime": Runtime})


def test_on_a_gpu_the_default_is_its_free_memory():
    cupy = FakeCupy([40 * GIB, 30 * GIB])
    (limit, source), ranks = gpu_max_memory("gpu", None, cupy)
    assert (limit, ranks) == (40 * GIB, 1) and "GPU 0" in source and "/ 1 rank(s)" in source
    assert gpu_max_memory("auto", None, cupy)[0][0] == 40 * GIB
    assert gpu_max_memory("cpu", None, cupy) == (None, 1)                 # forced host
    assert gpu_max_memory("auto", None, FakeCupy([])) == (None, 1)       # cupy, no GPU
    assert gpu_max_memory("auto", None, FakeCupy([GIB], broken=True)) == (None, 1)


def test_max_memory_falls_back_to_the_host_without_a_gpu(monkeypatch):
    monkeypatch.setattr(memory_limit, "try_import_cupy", lambda: None)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")       # no comm: the launcher's count
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_MEM_PER_NODE",
                 "SLURM_MEM_PER_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(memory_limit, "cgroup_limit", lambda *a: None)    # MemTotal's
    host = default_max_memory(None)
    assert "/ 4 rank(s)" in host[1]
    assert max_memory(None, None, "auto") == host == max_memory(None, None, "cpu")
    assert max_memory("3G", None, "gpu") == (3 * GIB, "--max-memory")
    monkeypatch.setattr(memory_limit, "try_import_cupy", lambda: FakeCupy([7 * GIB]))
    assert max_memory(None, None, "auto")[0] == 7 * GIB
    assert max_memory(None, None, "cpu") == host


def test_a_failed_query_is_a_value_error():
    cupy = FakeCupy([GIB])
    cupy.cuda.runtime.memGetInfo = staticmethod(lambda: 1 / 0)
    with pytest.raises(ValueError, match="ZeroDivisionError.*give --max-memory"):
        gpu_max_memory("gpu", None, cupy)


@pytest.mark.mpi(min_size=1)
def test_ranks_sharing_a_gpu_split_its_memory(monkeypatch):
    """Every rank of this test's node on one GPU: each gets its free memory over the node's
    ranks; two GPUs: node-local rank r on GPU r % 2, split among the ranks on it; the same
    bus id behind two indices (a GPU listed twice) counts as one; ranks without a GPU fall
    back to the host's default, divided by the node's ranks, with no collective more."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local, size = node.Get_rank(), node.Get_size()
    node.Free()
    (limit, _), ranks = gpu_max_memory("gpu", comm, FakeCupy([60 * GIB]))
    assert ranks == size and limit == 60 * GIB // size
    (limit, source), _ = gpu_max_memory("gpu", comm, FakeCupy([60 * GIB, 20 * GIB]))
    on_mine = len([r for r in range(size) if r % 2 == local % 2])
    assert limit == [60, 20][local % 2] * GIB // on_mine, source
    (limit, _), _ = gpu_max_memory("gpu", comm, FakeCupy([60 * GIB, 60 * GIB], ["a", "a"]))
    assert limit == 60 * GIB // size
    monkeypatch.setattr(memory_limit, "try_import_cupy",
                        lambda: FakeCupy([GIB]) if comm.Get_rank() == 0 else None)
    got = max_memory(None, comm, "auto")          # rank 0 a GPU, the others the host's
    if comm.Get_rank() == 0:
        assert got[0] == GIB                    # the one rank on that GPU
    else:
        assert got == default_max_memory(None, ranks=size)
    broken = FakeCupy([GIB])                    # the query fails on rank 0 alone: every
    if comm.Get_rank() == 0:                    # rank raises, none waits in the allgather
        broken.cuda.runtime.memGetInfo = staticmethod(lambda: 1 / 0)
    with pytest.raises(ValueError, match="could not be read"):
        gpu_max_memory("gpu", comm, broken)
    comm.Barrier()


@pytest.mark.mpi(min_size=1)
def test_layout_auto_prices_the_gpu_only_where_every_rank_has_one(monkeypatch):
    """agree_memory_limit: args.planned_device 'gpu' where every rank computes on a GPU, else
    'cpu' on every rank (one rank on the host prices the step as the host holds it; with
    one rank that case is all on the host, so `all` against `any` is told apart from 2
    ranks on)."""
    from types import SimpleNamespace

    from mpi4py import MPI

    from mpishard.cli.auto_layout import agree_memory_limit
    comm = MPI.COMM_WORLD
    for on_gpu, want in ((lambda r: True, "gpu"), (lambda r: r != 0, "cpu")):
        monkeypatch.setattr(memory_limit, "try_import_cupy", lambda: FakeCupy([GIB]) if
                            on_gpu(comm.Get_rank()) else None)
        args = SimpleNamespace(layout="auto", max_memory="1G", device="auto")
        agree_memory_limit(args, comm)
        assert args.planned_device == want
        assert args.max_memory_limit == (GIB, "--max-memory")
    args = SimpleNamespace(layout="auto", max_memory="1G", device="cpu")     # forced host
    agree_memory_limit(args, comm)
    assert args.planned_device == "cpu"
    monkeypatch.setattr(memory_limit, "try_import_cupy", lambda: None)
    args = SimpleNamespace(layout="auto", max_memory="1G", device="gpu")     # forced GPU: the
    agree_memory_limit(args, comm)                                # engine fails without one
    assert args.planned_device == "gpu"
