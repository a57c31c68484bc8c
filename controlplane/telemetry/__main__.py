"""Print docs/metrics.md: `python -m controlplane.telemetry > docs/metrics.md`."""

import sys

from controlplane.telemetry.catalog import render_markdown

sys.stdout.write(render_markdown())
