"""A module that says so, then exits 143: tests.prefork_signal_race's child."""

import os
import sys

sys.stdout.write("exiting\n")
sys.stdout.flush()
os._exit(143)
