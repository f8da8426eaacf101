"""benchmarks/gpu_wheels.py without pip: a wheel unpacks to pip's --prefix layout.

A synthetic wheel holds a package, a `.data/data/` tree (the mpich wheel's lib/ and bin/), a
`.data/scripts/` entry and a symbolic link member; unpacked, each lands where
`pip install --prefix` puts it, executables stay executable and the link stays a link.
"""
import os
import stat
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_wheels  # noqa: E402


def member(z, name, data, mode):
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    z.writestr(info, data)


def test_unpack_matches_pips_prefix_layout(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        member(z, "demo/__init__.py", "X = 1\n", stat.S_IFREG | 0o644)
        member(z, "demo-1.0.data/data/lib/libdemo.so.1", b"\x7fELF", stat.S_IFREG | 0o755)
        member(z, "demo-1.0.data/data/lib/libdemo.so", "libdemo.so.1", stat.S_IFLNK | 0o777)
        member(z, "demo-1.0.data/data/bin/demoexec", "#!/bin/sh\n", stat.S_IFREG | 0o644)
        member(z, "demo-1.0.data/scripts/demo-script", "#!/bin/sh\n", stat.S_IFREG | 0o755)
    prefix = tmp_path / "prefix"
    gpu_wheels.unpack(wheel, prefix)
    site = gpu_wheels.purelib(prefix)
    assert site == prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
        "site-packages"
    assert (site / "demo" / "__init__.py").read_text() == "X = 1\n"
    assert (prefix / "lib" / "libdemo.so.1").read_bytes() == b"\x7fELF"
    assert os.readlink(prefix / "lib" / "libdemo.so") == "libdemo.so.1"
    for exe in (prefix / "bin" / "demoexec", prefix / "bin" / "demo-script"):
        assert os.access(exe, os.X_OK), exe
    assert not os.access(site / "demo" / "__init__.py", os.X_OK)
