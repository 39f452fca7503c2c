"""The pure core: decisions and math with no processes, sockets or clocks.

Batching (step -> VWs -> samples), balancing (by count and by cost),
membership decisions, schedule tracking, the step statistics' layout, the
sample ledger and the evaluation split. Nothing here imports the rest of
flexpar (import-linter keeps it so: pyproject.toml); every device runs these
functions on the same inputs and gets the same answer.
"""
