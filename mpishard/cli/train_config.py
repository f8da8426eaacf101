"""`train --config FILE.toml`: a TOML table read as command-line tokens.

The config's keys are train's flag names (without '--'; '-' or '_'), turned into tokens that
argparse parses like the command line, so a value gets exactly the checks its flag gets; the
command line then wins over the file (cli/train.py parse_train_args).
"""
from __future__ import annotations

from .gpt_options import gpt_spec_text
from .usage import UsageError

try:
    import tomllib
except ImportError:                                        # Python < 3.11
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None


def load_toml(path):
    """The table of a --config TOML file; UsageError when it is missing or invalid."""
    if tomllib is None:
        raise UsageError("--config needs Python 3.11+ (tomllib) or `pip install tomli`")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config {path}: invalid TOML: {exc}") from None


def config_tokens(parser, config: dict, path="config") -> list:
    """A TOML table as command-line tokens for `parser` (keys are flag names without '--',
    '-' or '_'), so the values get exactly the checks the flags get. The keys a config may
    hold are `parser.config_options` (set by add_train_arguments)."""
    options = parser.config_options
    tokens = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if action is None:
            known = sorted(a[2:] for a in options if a.startswith("--"))
            raise UsageError(f"config {path}: unknown key {key!r}; known keys: "
                             f"{', '.join(known)}")
        if action.nargs == 0 or (action.const is True and isinstance(value, bool)):  # switch
            if not isinstance(value, bool):
                raise UsageError(f"config {path}: {key} must be true or false, got {value!r}")
            tokens += [flag] if value else []
            continue
        if isinstance(value, list) and key == "model":
            value = ",".join(str(v) for v in value)
        if isinstance(value, dict) and key == "gpt":          # a [gpt] table
            value = gpt_spec_text(value)
        if isinstance(value, (bool, dict, list)):
            raise UsageError(f"config {path}: {key} = {value!r} is not a valid value")
        tokens += [flag, str(value)]
    return tokens
