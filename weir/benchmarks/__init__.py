"""`weir bench` benchmarks, one module each (see weir.cli). Each prints a table and, with
`--json`, one JSON object, built with `weir.benchmarks._report`."""
