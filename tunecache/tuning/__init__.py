"""The tuning engine: candidates compiled in a pool, timed in isolated runners, the winner checked."""
