"""Where `weir router`, `weir sidecar` and `weir operator` read the control plane's Redis URL.

The URL carries the Redis password, so it can come from places that process listings do
not show: `--redis-url-file FILE` (a mounted Secret, first line) or the environment
variable `WEIR_REDIS_URL` (a Secret's key, as the chart and the operator pass it).
`--redis-url URL` still works; a password in it draws a warning.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV = "WEIR_REDIS_URL"


def add_redis_url_flags(
    container: argparse.ArgumentParser | argparse._ActionsContainer, what: str
) -> None:
    """`--redis-url` and `--redis-url-file`; `what`: the control plane's role here."""
    container.add_argument(
        "--redis-url", default="", help=f"{what} (default: ${ENV}); prefer --redis-url-file or "
        f"${ENV}: a password here shows in process listings",
    )  # fmt: skip
    container.add_argument(
        "--redis-url-file", default="", metavar="FILE",
        help="read the Redis URL from FILE (a mounted Secret)",
    )  # fmt: skip


def redis_url(args: argparse.Namespace, command: str, env: Mapping[str, str] = os.environ) -> str:
    """--redis-url, else --redis-url-file's URL, else $WEIR_REDIS_URL; "" for none.
    Raises ValueError for a file that cannot be read or holds no URL, and for a URL that
    `RedisSettings.from_url` cannot use (at start, not at the first connection)."""
    url = _given_url(args, command, env)
    if url:
        from controlplane.store.connection import RedisSettings

        RedisSettings.from_url(url)
    return url


def _given_url(args: argparse.Namespace, command: str, env: Mapping[str, str]) -> str:
    from controlplane.store.connection import redact_url  # not at import: `weir --help`

    if args.redis_url:
        if redact_url(args.redis_url) != args.redis_url:
            print(
                f"weir {command}: warning: the password in --redis-url shows in process "
                f"listings; pass the URL in ${ENV} or --redis-url-file instead",
                file=sys.stderr,
            )
        return str(args.redis_url)
    if args.redis_url_file:
        try:
            lines = Path(args.redis_url_file).read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read --redis-url-file {args.redis_url_file}: {exc}") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--redis-url-file {args.redis_url_file} holds no URL")
        return lines[0].strip()
    return env.get(ENV, "").strip()
