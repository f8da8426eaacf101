"""README.md and docs/ say what works: their links resolve, their commands parse, their ranks fit.

Serial tests (no MPI) except the last, which launches the README's Python quickstart on 4 ranks:
`pytest tests/integration/test_docs.py`.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import mpiexec_cmd
from mpishard.cli import build_parser
from mpishard.cli.usage import KEYED

try:
    import tomllib
except ImportError:                     # Python < 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "benchmarks" / "README.md", ROOT / "tests" / "README.md",
         ROOT / "hostfiles" / "README.md"]
REQUIRED_DOCS = ["strategies", "checkpoints", "reliability", "clusters", "gpus",
                 "planning-and-tracing", "performance"]
MESH_AXES = ("dp", "fsdp", "tp", "pp", "ep", "cp")
MPISHARD = re.compile(r"(?:^|\s)(?:\S*python\S*)\s+(?:-m\s+mpi4py\s+)?-m\s+mpishard\s+(\S.*)$")
MPIEXEC_N = re.compile(r"(?:^|\s)\S*mpiexec\b.*?\s-n\s+(\d+)\s")


def _code_blocks(text):
    """The fenced code blocks of a markdown text, each as a string."""
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _commands(text):
    """Shell lines of the code blocks, backslash continuations joined, comments dropped."""
    out = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _documented_mpishard_commands():
    """(page, line, argv after `-m mpishard`) for every documented mpishard command."""
    found = []
    for page in PAGES:
        for line in _commands(page.read_text()):
            m = MPISHARD.search(line)
            if m:
                found.append((page.name, line, shlex.split(m.group(1).replace("$", ""))))
    return found


def _layout_size(layout):
    size = 1
    for part in layout.split(","):
        axis, _, n = part.partition("=")
        if axis.strip() in MESH_AXES:
            size *= int(n)
    return size


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_readme_starts_with_the_two_commands_and_stays_short():
    text = README.read_text()
    first = _code_blocks(text)[0].splitlines()
    print(first)
    assert first[0].startswith("make demo ") and first[1].startswith("make test ")
    assert text.index("```") < text.index("## "), "the two commands come before any section"
    lines = text.count("\n")
    print(f"README.md: {lines} lines")
    assert lines <= 300
    assert "## Contents" in text


def test_the_docs_pages_exist_and_start_with_what_a_user_does():
    names = {p.stem for p in DOCS}
    assert set(REQUIRED_DOCS) <= names, sorted(set(REQUIRED_DOCS) - names)
    for page in DOCS:
        sections = re.findall(r"^## (.+)$", page.read_text(), re.MULTILINE)
        print(page.name, sections[:2])
        assert sections and sections[0] == "What you do", page.name


def test_every_relative_link_resolves():
    """Links to files exist; links with an anchor name a heading of the target page."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(),
                                                      re.MULTILINE)}
                if anchor not in slugs:
                    broken.append(f"{page.name}: {target} (no such heading)")
    print("\n".join(broken))
    assert not broken


def test_every_documented_command_parses():
    """Each `python -m mpishard ...` in a code block is accepted by the command's parser:
    no flag that does not exist, no argument where the flag takes none (`--resume DIR`)."""
    parser = build_parser()
    commands = _documented_mpishard_commands()
    assert len(commands) >= 20, len(commands)
    bad = []
    for page, line, argv in commands:
        try:
            parser.parse_args(argv)
        except (SystemExit, Exception) as exc:    # noqa: BLE001 - report every failure
            bad.append(f"{page}: {line}\n    {type(exc).__name__}: {exc}")
    print("\n".join(bad))
    assert not bad


def test_resume_shows_no_literal_directory():
    """`--resume` (from --checkpoint-dir), `--resume auto` or `--resume PATH`: prose must not
    show it with a literal directory, which reads as the old directory-taking form."""
    for page in PAGES:
        for code in re.findall(r"`([^`\n]+)`", page.read_text()):
            m = re.search(r"--resume\s+(\S+)", code)
            assert not m or m.group(1).startswith("-") or m.group(1).rstrip(":;,.") in (
                "auto", "PATH", "[auto|PATH]", "[auto\\|PATH]"), f"{page.name}: `{code}`"


def test_the_checkpoints_page_lists_every_form_of_resume():
    """docs/checkpoints.md's table of train's flags lists `--resume [auto|PATH]` and says
    what each form does, as `train --help` does."""
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    row = next((s for s in text.splitlines() if s.startswith("| `--resume")), "")
    assert row.startswith("| `--resume [auto\\|PATH]` |"), row
    assert all(form in row for form in ("bare:", "`auto`:", "`PATH`:")), row


def test_documented_jobs_have_the_ranks_their_layout_needs():
    """A documented `train`/`bench`/`infer`/`generate`/`serve` runs under `mpiexec -n N` with
    N the product of its layout's sizes, whether the layout is a flag or inside a --config
    file (`--layout auto` fits any N)."""
    checked, bad = 0, []
    for page, line, argv in _documented_mpishard_commands():
        if argv[0] not in ("train", "bench", "infer", "generate", "serve"):
            continue
        layout = None
        if "--layout" in argv:
            layout = argv[argv.index("--layout") + 1]
        elif "--config" in argv:
            cfg = tomllib.loads((ROOT / argv[argv.index("--config") + 1]).read_text())
            layout = cfg.get("layout")
        if layout in (None, "auto"):
            continue
        m = MPIEXEC_N.search(" " + line)
        if m is None and "-m mpi4py" in line:
            continue                    # a rank of a batch script: srun or mpiexec starts it
        ranks = int(m.group(1)) if m else 1
        checked += 1
        if _layout_size(layout) != ranks:
            bad.append(f"{page}: {layout} needs {_layout_size(layout)} ranks, shown with "
                       f"{ranks}: {line}")
    print(f"{checked} commands checked\n" + "\n".join(bad))
    assert checked >= 10 and not bad


def test_the_venv_is_activated_before_any_bare_command():
    """`python`/`mpiexec` in a code block mean the venv's: each page says to activate it
    (`. .venv/bin/activate`) before its first such command."""
    bare = re.compile(r"^(?:\S+=\S+\s+)*(python|mpiexec)\s", re.MULTILINE)
    for page in [README, *DOCS]:
        text = page.read_text()
        blocks = [b for b in _code_blocks(text) if bare.search(b)]
        if not blocks:
            continue
        first = text.index(blocks[0]) + bare.search(blocks[0]).start()
        assert ".venv/bin/activate" in text[:first], page.name


def test_readme_python_quickstart_runs_on_4_ranks(tmp_path):
    """The README's Python block, as written, trains, saves and restores on 4 ranks."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1
    for call in ("ms.checkpoint.save(", "ms.checkpoint.restore(", "make_engine("):
        assert call in blocks[0]
    script = tmp_path / "quickstart.py"
    script.write_text(blocks[0] + "\nassert step == 5, step\n"
                      "if engine.device_id == 0:\n    print('restored step', step)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([*mpiexec_cmd(4), sys.executable, "-m", "mpi4py", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert lines.count("restored step 5") == 1 and sum("step 5: loss" in s for s in lines) == 1


def _section(text, heading):
    """The text of a markdown section, from its `## heading` to the next `## `."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def test_downloads_use_hf_download_not_the_removed_huggingface_cli():
    """huggingface_hub replaced `huggingface-cli` by `hf`: no page shows the old command, and
    each documented `hf download` passes only options that `hf download --help` lists (when
    the hf extra installed the `hf` command here)."""
    old = [page.name for page in PAGES if "huggingface-cli" in page.read_text()]
    assert old == []
    downloads = [(page.name, line) for page in PAGES for line in _commands(page.read_text())
                 if re.match(r"hf\s+download\s", line)]
    print("\n".join(f"{page}: {line}" for page, line in downloads))
    assert {page for page, _ in downloads} >= {"README.md", "hugging-face.md"}
    hf = Path(sys.executable).parent / "hf"
    if not hf.exists():
        return
    usage = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, NO_COLOR="1")).stdout
    assert "Usage: hf download" in usage, usage
    for page, line in downloads:
        for option in (a.split("=")[0] for a in shlex.split(line) if a.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", usage), (page, option)


def _option_help(text) -> dict:
    """{'--flag METAVAR': its help as one line} of an argparse help text."""
    out, flag = {}, None
    for line in text.splitlines():
        m = re.match(r"  (-[-\w]+(?: [A-Z_|.]+)?)(?:\s{2,}(.*))?$", line)
        if m:
            flag = m.group(1)
            out[flag] = m.group(2) or ""
        elif flag and line.startswith(" " * 8) and line.strip():
            out[flag] += " " + line.strip()
        else:
            flag = None
    return out


ARCHITECTURE_NAMES = {"GPT2LMHeadModel": "GPT-2", "LlamaForCausalLM": "Llama",
                      "MixtralForCausalLM": "Mixtral", "Qwen2ForCausalLM": "Qwen2"}


def test_the_readme_and_train_help_name_every_hugging_face_architecture():
    """Every architecture ms.hf reads (GPT-2, Llama, Mixtral, Qwen2) is named in the README's
    Hugging Face section with its class, and in `train --help`: its class in --init-from-hf's
    help, and every kind --model builds (KIND:KEY=VALUE,...) with its keys in --model's (a
    Mixtral is a llama with n_experts). The help texts are built from the registries."""
    from mpishard.hf import ARCHITECTURES

    assert set(ARCHITECTURES) == set(ARCHITECTURE_NAMES)
    section = _section(README.read_text(), "Hugging Face models")
    for cls, name in ARCHITECTURE_NAMES.items():
        assert f"{name} (`{cls}`)" in section, cls
    option = _option_help(build_parser().commands["train"].format_help())
    print({flag: option[flag] for flag in ("--init-from-hf DIR", "--model MODEL")})
    for cls in ARCHITECTURE_NAMES:
        assert cls in option["--init-from-hf DIR"], cls
    for kind, spec in KEYED.items():
        assert f"{kind}: {', '.join(spec.flag_defaults)}" in option["--model MODEL"], kind
    assert "n_experts" in option["--model MODEL"]


CLOCK, DURATION = r"\d\d:\d\d:\d\d\.\d{3}", r"for \d+\.\d\d s"


def _shape(shown):
    """A regular expression for a line the docs show: itself, but any clock time and duration,
    and anything in place of `...`."""
    return "".join(".*" if part == "..." else CLOCK if re.fullmatch(CLOCK, part)
                   else DURATION if re.fullmatch(DURATION, part) else re.escape(part)
                   for part in re.split(rf"(\.\.\.|{CLOCK}|{DURATION})", shown))


def test_reliability_md_shows_what_a_stall_prints(tmp_path):
    """docs/reliability.md's timeout line and `flight` report are what `train` and `flight`
    print when rank 1 of 2 is stuck in its loss at step 3, line for line."""
    from conftest import run_mpi
    from test_flight_faults import CLI_SCRIPT

    page = (ROOT / "docs" / "reliability.md").read_text()
    script, directory = tmp_path / "stall.py", tmp_path / "flight"
    script.write_text(CLI_SCRIPT)
    proc = run_mpi(2, script, directory, timeout=120)
    report = subprocess.run([sys.executable, "-m", "mpishard", "flight", str(directory)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    print(proc.stderr[-2000:], report)
    blocks = _code_blocks(page)
    shown = next(line for b in blocks for line in b.splitlines()
                 if line.startswith("mpishard: error: CollectiveTimeout:"))
    printed = [line for line in proc.stderr.splitlines() if "CollectiveTimeout" in line]
    assert len(printed) == 1 and re.fullmatch(_shape(shown), printed[0]), (shown, printed)
    shown = next(b for b in blocks if b.startswith("flight: ")).splitlines()
    printed = report.splitlines()
    assert len(shown) == len(printed), (shown, printed)
    for line, real in zip(shown, printed):
        assert re.fullmatch(_shape(line), real), (line, real)
