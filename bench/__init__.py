"""The benchmark harness: the relay against a raw-SQL baseline, in the same run.

Run it with ``make bench`` (``python -m bench --help`` for the options). Every
figure that depends on the machine is reported as a ratio against a baseline
measured in the same run; see bench/README.md for the figures and targets.
"""
