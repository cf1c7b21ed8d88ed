"""A worker process's life: starting N of them without torchrun, stopping on a signal, dying with its
launcher, and leaving with a stated exit code.
"""
