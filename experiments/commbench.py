"""Collective-communication benchmark in the manner of nccl-tests; the tool lives in tools/commbench.py."""

KIND = "tool"
TOOL = "tools.commbench"  # run by its module's name, as ``python -m`` would: experiments import nothing of tools

if __name__ == "__main__":
    import importlib

    importlib.import_module(TOOL).main.run_and_exit()
