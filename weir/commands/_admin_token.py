"""The admin routes' bearer token of `weir sidecar` and `weir router`: read from a file
(`--admin-token-file`, a mounted Secret) or the environment (`WEIR_ADMIN_TOKEN`), never
from the command line, where process listings would show it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

ENV = "WEIR_ADMIN_TOKEN"


def add_admin_token_flag(parser: argparse.ArgumentParser, routes: str) -> None:
    parser.add_argument(
        "--admin-token-file",
        default="",
        metavar="FILE",
        help=f"the bearer token of {routes}, read from FILE (default: ${ENV}; neither: "
        "they are open)",
    )


def admin_token(token_file: str, env: Mapping[str, str] = os.environ) -> str:
    """The admin token from `token_file`, else from $WEIR_ADMIN_TOKEN; "" for none.
    Raises ValueError for a file that cannot be read or holds no token."""
    if not token_file:
        return env.get(ENV, "").strip()
    try:
        token = Path(token_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --admin-token-file {token_file}: {exc}") from None
    if not token:
        raise ValueError(f"--admin-token-file {token_file} is empty")
    return token
