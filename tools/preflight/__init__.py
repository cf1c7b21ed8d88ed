"""Preflight: check a whole (multi-node) job before the real run (``tools.preflight.main`` says how).

One module per job: ``probes`` (what each rank finds out about itself, and what the ranks measure together),
``verdicts`` (every rank's facts in, one row of the table out), ``nccl_log`` (NCCL's own INFO log: which
transport it chose), ``table`` (the table and the JSON), and ``main`` (the options and the run).
"""
