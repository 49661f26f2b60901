"""``moonplan doctor``: find and remove what killed moonplan jobs left on this host.

A job killed while its shared-memory heap was being created can leave empty
``/dev/shm/moonplan-*`` files (see ``moonplan.comm.shm_files``); every later heap
creation removes them, and so does this command. Files of running processes, of
other users or of other pid namespaces are listed and kept.
"""

from __future__ import annotations

import argparse
from typing import Any

from moonplan.cli.args import add_subcommand
from moonplan.cli.choices import SHM_DIR

HELP = "remove /dev/shm files that killed moonplan jobs left behind"
DESCRIPTION = "Remove the shared-memory heap files of dead moonplan processes."


def register(subparsers: Any) -> None:
    """Add the ``doctor`` subcommand (handler in ``args.func``)."""
    p = add_subcommand(subparsers, "doctor", handler, HELP, DESCRIPTION)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list what would go, remove nothing (default: remove)",
    )
    p.add_argument("--dir", default=SHM_DIR, help=f"directory to clean (default {SHM_DIR})")


def handler(args: argparse.Namespace) -> int:
    """List and remove stale heap files; 0 (also when there was nothing to do)."""
    from moonplan.comm.shm_files import remove_stale_files

    out = remove_stale_files(args.dir, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in out.removed:
        print(f"{verb} {args.dir}/{name}")
    for name, why in out.kept.items():
        print(f"kept {args.dir}/{name}: {why}")
    print(f"moonplan doctor: {verb} {len(out.removed)} stale file(s), kept {len(out.kept)}")
    return 0
