"""Real workloads built from data packages ship (no downloads): programs to run, with their oracles."""
