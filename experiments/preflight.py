"""Preflight: check a whole (multi-node) job before the real run; the tool lives in tools/preflight/."""

KIND = "tool"
TOOL = "tools.preflight.main"  # run by its module's name, as ``python -m`` would: experiments import nothing of tools

if __name__ == "__main__":
    import importlib

    importlib.import_module(TOOL).main.run_and_exit()
