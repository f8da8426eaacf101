"""train's checkpoint flags: --checkpoint-dir, --checkpoint-every and --resume checked together
(no MPI; the same on every rank), so a run never starts towards a directory it cannot use."""
from __future__ import annotations

import os

from ..checkpoint import is_checkpoint
from ..checkpoint.storage import foreign_entries
from .cluster_options import validate_cluster_args
from .usage import UsageError


def validate_checkpoint_args(args):
    """--checkpoint-dir / --checkpoint-every / --resume (no MPI; the same on every rank)."""
    if args.checkpoint_dir is None:
        if args.checkpoint_every:
            raise UsageError("--checkpoint-every needs --checkpoint-dir DIR")
        return validate_cluster_args(args, False)
    path = os.path.abspath(args.checkpoint_dir)
    if not os.path.isdir(os.path.dirname(path)):
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir}: directory "
                         f"{os.path.dirname(path)} does not exist")
    complete = is_checkpoint(path)
    validate_cluster_args(args, complete)
    if not complete and os.path.exists(path) and (not os.path.isdir(path) or
                                                  foreign_entries(path)):  # not a crashed save's
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} exists and is not a "
                         f"checkpoint; refusing to replace it")
