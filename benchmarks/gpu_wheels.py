"""Install the GPU check's carried wheels offline into a scratch prefix, with or without pip.

`install(wheels, prefix, run)` puts the wheels under `prefix` the way
`pip install --no-index --no-deps --prefix PREFIX` lays them out: packages in
PREFIX/lib/pythonX.Y/site-packages (returned), a wheel's `*.data/data/` tree under PREFIX itself
(the mpich wheel's lib/libmpi.so.12 and bin/mpiexec), `*.data/scripts/` in PREFIX/bin. `--prefix`
and not `--target`: pip's --target keeps only the packages and drops the mpich wheel's lib/.

pip is used when this interpreter has it (`run(cmd, seconds)` runs it and returns its exit
status); an image without pip gets the same layout by unpacking the zip files here: executable
bits and symbolic links (libmpi.so -> libmpi.so.12) are restored from each member's mode.
"""
from __future__ import annotations

import importlib.util
import os
import stat
import sys
import zipfile
from pathlib import Path


def purelib(prefix: Path) -> Path:
    return prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def install(wheels, prefix: Path, run, seconds) -> tuple:
    """(site-packages folder, "pip" or "unzip"); raises RuntimeError if pip fails."""
    if importlib.util.find_spec("pip") is not None:
        rc = run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                  "--no-warn-script-location", "--prefix", prefix, *wheels], seconds)
        if rc:
            raise RuntimeError(f"pip install exited {rc}")
        return next(prefix.glob("lib/python*/site-packages")), "pip"
    for wheel in wheels:
        unpack(Path(wheel), prefix)
    return purelib(prefix), "unzip"


def destination(name: str, prefix: Path) -> Path:
    """Where a wheel member goes under `prefix` (pip's --prefix scheme)."""
    head, _, rest = name.partition("/")
    if head.endswith(".data"):
        kind, _, rest = rest.partition("/")
        base = {"data": prefix, "scripts": prefix / "bin"}.get(kind, purelib(prefix))
        return base / rest
    return purelib(prefix) / name


def unpack(wheel: Path, prefix: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            path = destination(info.filename, prefix)
            path.parent.mkdir(parents=True, exist_ok=True)
            mode = info.external_attr >> 16
            data = z.read(info)
            if stat.S_ISLNK(mode):
                if path.is_symlink() or path.exists():
                    path.unlink()
                os.symlink(data.decode(), path)
                continue
            path.write_bytes(data)
            if mode & 0o111 or "/bin/" in f"/{info.filename}":
                path.chmod(0o755)
