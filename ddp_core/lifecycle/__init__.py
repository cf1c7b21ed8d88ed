"""The run's rules as components, each owning its state, defaults and cadence (docs/design.md's picture).

``plan``: the run's shape; ``position``: where it stands and where a resume continues; ``checkpointer``: when
to save, what a checkpoint holds, how a resume puts it back; ``metrics_log``: what is logged and evaluated,
and when; ``log_point``: a log point's figures; ``stop_policy``: why a run ends early; ``parts``: builds them
before the loop; ``loop``: the coordinator that calls them after each step.
"""
