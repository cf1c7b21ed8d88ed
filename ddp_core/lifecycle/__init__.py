"""The run's rules as components, each owning its state, defaults and cadence (docs/design.md lists each module)."""
