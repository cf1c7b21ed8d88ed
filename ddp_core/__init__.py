"""ddp_core: what every ddp-lab experiment shares, in layers (docs/design.md, "Layers"; tests/unit/test_layers.py)."""
