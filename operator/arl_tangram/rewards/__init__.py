"""The reward runtime: the process in reward pods that hosts several services on one GPU chunk."""
