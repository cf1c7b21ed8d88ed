"""ddp_core: what every ddp-lab experiment shares. Nothing here knows about a particular experiment.

Its packages are layers, each importing only the ones below it: docs/design.md, "Layers"
(tests/unit/test_layers.py keeps them).
"""
