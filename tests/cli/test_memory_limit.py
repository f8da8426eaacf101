"""--max-memory: its parsing and its default from fake cgroup files, Slurm variables and
/proc/meminfo (cli/memory_limit.py), no MPI."""
import pytest

from mpishard.cli.memory_limit import default_max_memory, job_memory, node_ranks, parse_bytes

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
