"""Subcommands of `weir`, one module each (see weir.cli)."""
