"""ddp_core.training.host_memory: after ``keep_freed_memory`` the memory a step frees is taken again without page
faults; a user's own allocator settings are kept.

The churn runs in a fresh interpreter (glibc's thresholds are per process and this one's are already moved): it
allocates and touches eight 4 MiB blocks, frees them, and counts the minor page faults of the next rounds, before
and after the call. That is the pattern of a CPU training step's activations, without torch. Which settings count as the
user's is a table of environments, read in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_core.training.host_memory import users_choice

CHURN = """
import ctypes, json, resource
from ddp_core.training.host_memory import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 4 * 2**20

def faults_per_round(rounds=4):
    def one_round():
        blocks = [libc.malloc(SIZE) for _ in range(8)]
        for block in blocks:
            ctypes.memset(block, 1, SIZE)
        for block in blocks:
            libc.free(block)
    one_round()  # the first takes its pages in any case
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        one_round()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds

without = faults_per_round()
did = keep_freed_memory()
print(json.dumps({"without": without, "did": did, "with": faults_per_round()}))
"""
REPO = Path(__file__).resolve().parents[2]
PAGES_PER_ROUND = 8 * 4 * 2**20 // 4096


def churn(**env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHURN],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={"PATH": "/usr/bin", **env},
    )
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_taken_again_without_page_faults_and_a_users_setting_is_kept():
    default = churn()
    # glibc's default: each round's blocks go back to the kernel and come again page by page
    assert default["without"] > PAGES_PER_ROUND / 2
    assert default["did"] == "set"
    assert default["with"] < PAGES_PER_ROUND / 100  # kept: next to none
    users = churn(MALLOC_TOP_PAD_="131072")  # a setting of the user's own (it also stops glibc's own heuristics)
    assert users["did"] == "kept: MALLOC_TOP_PAD_ is set"
    assert users["with"] > PAGES_PER_ROUND / 2  # nothing changed


@pytest.mark.parametrize(
    ("environ", "chosen"),
    [
        ({}, None),
        ({"MALLOC_ARENA_MAX": "2"}, None),  # arenas, not thresholds: ours still apply
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_MMAP_THRESHOLD_": ""}, "MALLOC_MMAP_THRESHOLD_"),  # set, even empty: the user's
        ({"MALLOC_MMAP_MAX_": "0"}, "MALLOC_MMAP_MAX_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES"),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}, None),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
        ({"LD_PRELOAD": " "}, None),
    ],
)
def test_a_users_own_allocator_settings_are_named(environ, chosen):
    assert users_choice(environ) == chosen
