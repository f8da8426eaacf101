"""Structure numbers of a package tree: modules, largest files, package imports inside
functions, import cycles, private names imported across modules, other libraries' private API.

    python benchmarks/structure_report.py                  # this checkout's mpishard/
    python benchmarks/structure_report.py /tmp/before/mpishard

The measurements are the helpers of tests/integration/test_structure.py, so the numbers mean
exactly what the structure test enforces; the tree is read with `ast`, never imported.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_structure as rules  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default=str(rules.PACKAGE),
                        help="the package folder to measure (default: this checkout's mpishard/)")
    parser.add_argument("--largest", type=int, default=8, help="how many of the largest files")
    args = parser.parse_args(argv)

    package = Path(args.package).resolve()
    parsed = rules.parse_package(package)
    lines = rules.line_counts(parsed, package)
    nested = rules.package_imports_in_functions(parsed)
    cycles = rules.import_cycles(parsed)
    dodged = rules.import_cycles(parsed, with_functions=True)
    _, groups = rules.import_groups(parsed, with_functions=True)
    underscore = rules.underscore_imports(parsed)
    private = rules.private_api_uses(parsed)

    print(f"package: {package}")
    print(f"modules: {len(parsed)} ({len(rules.top_level_modules(package))} at the top level), "
          f"{sum(lines.values())} lines")
    print(f"largest files (over {rules.MAX_LINES} lines: "
          f"{sum(n > rules.MAX_LINES for n in lines.values())}):")
    for rel, n in list(lines.items())[:args.largest]:
        print(f"  {n:5d}  {rel}")
    print(f"package imports inside functions: {len(nested)} "
          f"(in {len({imp.path for imp in nested})} files)")
    print(f"import cycles: {len(cycles)} at module level, {len(dodged)} counting the imports "
          "inside functions")
    for cycle, group in zip(dodged, groups):
        print(f"  {' -> '.join(cycle)}   ({len(group)} modules in the group"
              f"{', at module level' if cycle in cycles else ''})")
    names = [n for imp in underscore for n in imp.names if rules.is_private(n)]
    print(f"underscore names imported across modules: {len(names)} in {len(underscore)} "
          f"statements ({len(set(names))} distinct: {', '.join(sorted(set(names)))})")
    print(f"private API of other libraries: {len(private)}")
    for where in private:
        print("  " + where)


if __name__ == "__main__":
    main()
